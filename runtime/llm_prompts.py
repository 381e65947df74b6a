"""vLLM's prompt dicts (`from vllm import TextPrompt, TokensPrompt`), as TypedDicts: `LLM.generate` takes them,
and plain dicts of the same keys, anywhere it takes a text or a list of token ids.

Only the fields this engine honours are declared (`cache_salt`: a non-empty string; the prompt's cached prefix
blocks are found only by prompts with the same salt). vLLM's others: `multi_modal_data` (None or absent only: a
value is a ValueError, the engine serves text-only decoder models), `mm_processor_kwargs` and `token_type_ids`
(ignored)."""

from typing_extensions import NotRequired, TypedDict  # NotRequired: typing has it from Python 3.11


class TextPrompt(TypedDict):
    """A text prompt, tokenized by the model's tokenizer (special tokens added, as for a plain string)."""

    prompt: str
    cache_salt: NotRequired[str]


class TokensPrompt(TypedDict):
    """A prompt given as token ids, which go to the model as they are (no special tokens added). `prompt`, when
    given, is ignored (the ids are what runs)."""

    prompt_token_ids: list[int]
    prompt: NotRequired[str]
    cache_salt: NotRequired[str]
