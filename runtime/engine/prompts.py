"""A request's prompt as token ids: a text is tokenized, token ids are range-checked, and SamplingParams'
`truncate_prompt_tokens` keeps the last k (vLLM's offline field; the OpenAI server applies the same rule)."""

from __future__ import annotations

from typing import Any

from fxrewrite.errors import UserInputError, UserTypeError, check_unicode, is_integer


def prompt_cache_salt(prompt: Any) -> str | None:
    """A TextPrompt / TokensPrompt dict's ``cache_salt`` (vLLM's), else None; UserInputError unless it is a non-empty
    string."""
    salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise UserInputError(f"cache_salt must be a non-empty string, got {type(salt).__name__} {salt!r:.60}")
    return salt


def tokenize_prompt(tokenizer: Any, vocab_size: int, prompt: str | list[int]) -> tuple[str | None, list[int]]:
    """(the prompt's text or None for token ids, its token ids). UserInputError naming the bad value: a token
    id outside [0, vocab_size), an empty prompt, invalid unicode; UserTypeError (also a ValueError) for a non-int
    element or another prompt type. vLLM's prompt dicts (TextPrompt {"prompt": text}, TokensPrompt
    {"prompt_token_ids": ids}, whose "prompt" is then ignored) are taken as their text / ids, as `LLM.generate`
    takes them (`LLMEngine.add_request` is called with them by vLLM users driving the engine)."""
    if isinstance(prompt, dict):
        if prompt.get("multi_modal_data") is not None:  # not dropped silently
            raise UserInputError("multi_modal_data is not supported: the engine serves text-only decoder models")
        if "prompt_token_ids" in prompt:
            prompt = prompt["prompt_token_ids"]
            if not isinstance(prompt, (list, tuple)):  # a string here is no text prompt
                raise UserTypeError(f"prompt_token_ids must be a list of token ids (ints), got "
                                    f"{type(prompt).__name__} {prompt!r:.60}")
        elif "prompt" in prompt:
            prompt = prompt["prompt"]
            if not isinstance(prompt, str):
                raise UserTypeError(f"a TextPrompt's 'prompt' must be a string, got {type(prompt).__name__}")
        else:
            raise UserInputError(f"prompt {prompt!r:.80} has neither 'prompt' nor 'prompt_token_ids'")
    if isinstance(prompt, str):
        token_ids = tokenizer.encode(check_unicode(prompt, "prompt"))
        text = prompt
        if token_ids and max(token_ids) >= vocab_size:  # a tokenizer of another model (`tokenizer=`)
            raise UserInputError(f"prompt token id {max(token_ids)} (the tokenizer's) is out of range "
                                 f"[0, {vocab_size}): the tokenizer does not fit the model's vocabulary")
    elif isinstance(prompt, (list, tuple)) and all(is_integer(t) for t in prompt):
        token_ids, text = [int(t) for t in prompt], None
        bad = [t for t in token_ids if not 0 <= t < vocab_size]
        if bad:
            raise UserInputError(f"prompt token id {bad[0]} is out of range [0, {vocab_size})")
    elif isinstance(prompt, (list, tuple)):
        i, bad = next((i, t) for i, t in enumerate(prompt) if not is_integer(t))
        raise UserTypeError(f"prompt token ids must be ints: element {i} is {type(bad).__name__} {bad!r}")
    else:
        raise UserTypeError(f"prompt must be a string, a list of token ids or a TextPrompt / TokensPrompt dict, got "
                            f"{type(prompt).__name__}")
    if not token_ids:
        raise UserInputError("prompt is empty: at least 1 token is needed")
    return text, token_ids


def truncate_prompt(token_ids: list[int], keep: int | None, max_model_len: int) -> list[int]:
    """The prompt's last `keep` tokens (-1: max_model_len; None: all of them). UserInputError for any other
    `keep` outside [1, max_model_len] (0 would leave an empty prompt)."""
    if keep is None:
        return token_ids
    if keep != -1 and not 1 <= keep <= max_model_len:
        raise UserInputError(f"truncate_prompt_tokens={keep} must be -1 or in [1, {max_model_len}] (at most "
                             "max_model_len)")
    return token_ids[-(max_model_len if keep == -1 else keep):]
