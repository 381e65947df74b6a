"""Offline API: `LLM(...)`, `generate()`, `chat()`, `embed()` and `score()` (runner="pooling"), as in vLLM."""

from __future__ import annotations

import dataclasses
import itertools
import os
import threading
from typing import Any, Sequence

from fxrewrite.errors import UserInputError, UserTypeError, check_unicode
from fxrewrite.runtime.engine_config import EngineConfig
from fxrewrite.runtime.engine.chat import (as_content_format, check_role, render_chat, resolve_chat_template,
                                           with_reasoning)
from fxrewrite.runtime.engine.data_parallel import make_engine
from fxrewrite.runtime.engine.outputs import RequestOutput
from fxrewrite.runtime.engine.pooling import EmbeddingRequestOutput, PoolingParams
from fxrewrite.runtime.engine.sampling_params import SamplingParams
from fxrewrite.runtime.engine.scoring import (ScoringRequestOutput, check_pair_counts, dedupe, renamed_prompt_error,
                                             score_outputs)
from fxrewrite.runtime.gc_passes import fewer_gc_passes
from fxrewrite.runtime.llm_compat import (check_content_format, check_request_kwargs,
                                          with_unsupported_methods)
from fxrewrite.runtime.llm_prompts import TextPrompt, TokensPrompt
from fxrewrite.runtime.server.generation_defaults import check_generation_config, load_generation_defaults


@with_unsupported_methods  # vLLM's beam_search, encode, classify, ...: NotImplementedError naming what to use
class LLM:
    """A model ready to generate. Takes vLLM's arguments (see `EngineConfig`, and `engine_config.VLLM_COMPAT_KWARGS`
    for those accepted with the values that match this engine); TypeError names an unknown one, ValueError a bad value.

        llm = LLM(model="Qwen/Qwen3-0.6B", model_impl="transformers")
        out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=16))
        print(out[0].outputs[0].text)
    """

    def __init__(self, model: str | None = None, *, generation_config: str | os.PathLike = "auto", **kwargs: Any):
        """generation_config: where `generate` / `chat` without sampling_params take their defaults
        (`get_default_sampling_params`): "auto", the model folder's generation_config.json when it has one;
        "vllm", none (SamplingParams' own); any other string (or path), a folder that must hold one. Raised here,
        before the model loads, naming the value: TypeError for a value that is not a non-empty string,
        FileNotFoundError for a folder without the file, ValueError for a file that is not a JSON object or holds
        a value SamplingParams refuses. The model's own file ("auto") is read on first use, as vLLM does: a
        broken one fails only calls without sampling_params."""
        self._generation_config = _check_generation_config(generation_config)
        self._generation_defaults: dict[str, Any] | None = None
        self.llm_engine = make_engine(EngineConfig.from_kwargs(model=model, **kwargs))  # DP: a DPLLMEngine
        self._request_counter = itertools.count()
        self._engine_lock = threading.Lock()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    @property
    def model_config(self):
        """vLLM's `llm.model_config`: the engine's ModelConfig (`max_model_len`, `hf_config`, `dtype`, ...)."""
        return self.llm_engine.model_config

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` / `chat` use when given no sampling_params, as in vLLM: a new SamplingParams with the
        generation_config's temperature, top_p, top_k, min_p, repetition_penalty and max_new_tokens (as
        max_tokens) over SamplingParams' defaults; plain SamplingParams() with generation_config="vllm"."""
        if self._generation_defaults is None:
            self._generation_defaults = load_generation_defaults(self.llm_engine.model_config.model_path,
                                                                 self._generation_config)
        return SamplingParams(**self._generation_defaults)

    # RL (runtime/engine/rl.py): weight sync and sleep mode, as vLLM's LLM has them. Each waits for a `generate`
    # running in another thread to finish (the same lock): a sync between two of its steps would mix weights.
    def load_weights(self, weights, strict: bool = True) -> set[str]:
        """Update the weights in place from a model or (name, tensor) pairs; see `LLMEngine.load_weights`."""
        with self._engine_lock:
            return self.llm_engine.load_weights(weights, strict)

    def sleep(self, level: int = 1) -> None:
        """Free the KV cache (and offload / discard the weights); see `LLMEngine.sleep`."""
        with self._engine_lock:
            self.llm_engine.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Undo `sleep` (a no-op without one); see `LLMEngine.wake_up`."""
        with self._engine_lock:
            self.llm_engine.wake_up(tags)

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """Forget every cached prefix (their K/V are stale after a weight change); True, as vLLM's on success. It
        always succeeds: running requests keep their blocks, which are only no longer found by later prompts, so
        vLLM's `reset_running_requests` (preempt them to free their blocks) has nothing to do, and there is no KV
        connector (`reset_connector`)."""
        with self._engine_lock:
            self.llm_engine.reset_prefix_cache()
        return True

    def generate(
        self,
        prompts: str | list[int] | TextPrompt | TokensPrompt | Sequence[str | list[int] | TextPrompt | TokensPrompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        *,
        lora_request: Any = None,
        priority: list[int] | None = None,
        tokenization_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt (text, token ids, or a TextPrompt / TokensPrompt dict) to completion; outputs in the
        order of `prompts`. sampling_params None: `get_default_sampling_params()` for every prompt (the model's
        generation_config). lora_request, priority, tokenization_kwargs: vLLM's, accepted at its defaults (None;
        priority all 0), NotImplementedError naming the feature otherwise (`llm_compat.check_request_kwargs`).

        ValueError (naming the prompt's index and the limit) when a prompt is invalid (longer than
        max_model_len, or prompt + max_tokens, capped at max_model_len, more than the KV cache holds); then
        nothing runs. Generation stops at max_model_len with finish_reason "length", whatever max_tokens;
        without max_tokens, also where the KV cache is full when it holds less (`LLMEngine.max_seq_len`).
        """
        prompts = _prompt_list(prompts)
        check_request_kwargs("generate", len(prompts), lora_request=lora_request, priority=priority,
                             tokenization_kwargs=tokenization_kwargs)
        self._check_generates("generate")
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        return self._submit(prompts, _per_prompt(sampling_params, len(prompts)), use_tqdm)

    def _check_generates(self, method: str) -> None:
        if self.llm_engine.config.is_pooling:
            raise UserInputError(f"LLM.{method}: this LLM was made with runner='pooling'; it embeds: call "
                                 "LLM.embed(prompts), or make the LLM without runner='pooling' to generate")

    def embed(self, prompts: str | list[int] | Sequence[str | list[int]], pooling_params: PoolingParams | None = None,
              use_tqdm: bool = True, *, truncate_prompt_tokens: int | None = None) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (text or token ids), in order: `output.outputs.embedding` is a list of
        hidden_size floats, the last token's final hidden state L2-normalised (vLLM's default pooler for
        a decoder LM). `truncate_prompt_tokens`: embed each prompt's last k tokens (vLLM's; -1: max_model_len
        of them), else pooling_params' own. Needs LLM(..., runner="pooling"); ValueError otherwise, or for a bad
        prompt."""
        if not self.llm_engine.config.is_pooling:
            raise UserInputError("LLM.embed needs LLM(model, runner='pooling') (vLLM's pooling runner); this LLM "
                                 "generates")
        prompts = _prompt_list(prompts)
        if pooling_params is not None and not isinstance(pooling_params, PoolingParams):
            raise UserTypeError(f"pooling_params must be a PoolingParams, got {type(pooling_params).__name__}")
        pooling_params = pooling_params or PoolingParams()
        if truncate_prompt_tokens is not None:
            if pooling_params.truncate_prompt_tokens not in (None, truncate_prompt_tokens):
                raise UserInputError(f"truncate_prompt_tokens={truncate_prompt_tokens} and pooling_params' "
                                     f"truncate_prompt_tokens={pooling_params.truncate_prompt_tokens} differ: give one")
            pooling_params = dataclasses.replace(pooling_params, truncate_prompt_tokens=truncate_prompt_tokens)
        return self._submit(list(prompts), [pooling_params] * len(prompts), use_tqdm)

    def score(self, data_1: str | list[int] | Sequence[str | list[int]],
              data_2: str | list[int] | Sequence[str | list[int]], /, *, truncate_prompt_tokens: int | None = None, use_tqdm: bool = True,
              pooling_params: PoolingParams | None = None, lora_request: Any = None) -> list[ScoringRequestOutput]:
        """vLLM's Score API for an embedding model: the cosine similarity of each pair's embeddings (`LLM.embed`'s),
        `output.outputs.score` a float in [-1, 1]. data_1 / data_2: a prompt (text, token ids, TextPrompt /
        TokensPrompt dict) or a list of them; pairs 1:1, 1:N (the one data_1 against each data_2) or N:N (pairwise),
        one output per pair in data_2's order. Each distinct prompt is embedded once. truncate_prompt_tokens /
        pooling_params: as `embed` (the score is the same with or without normalisation). ValueError (vLLM's wording)
        for an LLM without runner='pooling', naming both counts when they do not pair, naming `data_2[1]` (say)
        for a bad prompt."""
        if not self.llm_engine.config.is_pooling:
            raise UserInputError("LLM.score() is only supported for pooling models. Try passing runner='pooling' "
                                 "(`--runner pooling`) to use the model as a pooling model.")
        sides = []
        for name, data in (("data_1", data_1), ("data_2", data_2)):
            try:
                sides.append(_prompt_list(data))
            except ValueError as e:
                raise renamed_prompt_error(e, _item_names(name, data)) from None
        check_pair_counts(len(sides[0]), len(sides[1]))
        check_request_kwargs("score", len(sides[1]), lora_request=lora_request)
        distinct, slots = dedupe(sides[0] + sides[1])
        names = _item_names("data_1", data_1) + _item_names("data_2", data_2)  # `data_1` for a single prompt
        try:
            embedded = self.embed(distinct, pooling_params, use_tqdm, truncate_prompt_tokens=truncate_prompt_tokens)
        except ValueError as e:
            raise renamed_prompt_error(e, [names[slots.index(k)] for k in range(len(distinct))]) from None
        n = len(sides[0])
        return score_outputs(embedded, slots[:n], slots[n:], getattr(self.get_tokenizer(), "pad_token_id", None))

    def _submit(self, prompts: list, params: list, use_tqdm: bool) -> list:
        """Add every prompt with its params and run them all; nothing stays queued on an error. Calls from several
        threads run one after another (the engine steps every request it holds: two loops would take each other's)."""
        with self._engine_lock:
            return self._submit_now(prompts, params, use_tqdm)

    def _submit_now(self, prompts: list, params: list, use_tqdm: bool) -> list:
        ids = [str(next(self._request_counter)) for _ in prompts]
        try:
            for i, (request_id, prompt, p) in enumerate(zip(ids, prompts, params)):
                try:
                    self.llm_engine.add_request(request_id, prompt, p, final_only=True)
                except ValueError as e:  # the same kind, naming the prompt
                    raise (UserTypeError if isinstance(e, TypeError) else UserInputError)(f"prompt {i}: {e}") from None
            return self._run(ids, use_tqdm)
        except BaseException:
            for request_id in ids:
                self.llm_engine.abort_request(request_id)
            raise

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        from tqdm.auto import tqdm

        engine, results = self.llm_engine, {}
        # `disable` only when use_tqdm is False: an explicit value would override tqdm's TQDM_DISABLE=1
        off = {} if use_tqdm else {"disable": True}
        bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True, **off)
        with bar, fewer_gc_passes():
            while engine.has_unfinished_requests():
                for output in engine.step():
                    if output.finished:
                        results[output.request_id] = output
                        bar.update(1)
                failed = engine.take_failed_requests()
                if failed:  # the rest of the call is aborted by generate's caller
                    raise RuntimeError("; ".join(f"request {rid}: {why}" for rid, why in failed.items()))
        return [results[request_id] for request_id in ids]

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict | None = None,
        *,
        lora_request: Any = None,
        chat_template_content_format: str = "auto",
        mm_processor_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """Apply the chat template to one conversation (list of {"role", "content"}) or a list of them,
        then `generate` (sampling_params None: `get_default_sampling_params()`), as vLLM's LLM.chat does.

        tools: OpenAI tool dicts ({"type": "function", "function": {...}}) given to the template (the
        model's tool calls come back as its text, as in vLLM's LLM.chat). continue_final_message: leave
        the last message (any role; usually a prefilled assistant's) open so the model continues it; needs
        add_generation_prompt=False. ValueError when the tokenizer has no chat template, for a bad
        message, or for a template that cannot render `tools`. Each output's `prompt` is the rendered
        conversation text (as in vLLM), its `prompt_token_ids` that text's tokens. chat_template_content_format:
        "auto" / "string" (text parts joined into one string) or "openai" (the template gets the list of text
        parts); lora_request, mm_processor_kwargs: as in `generate`."""
        self._check_generates("chat")
        content_format = check_content_format(chat_template_content_format)
        if not isinstance(messages, (list, tuple)) or not messages:
            raise UserTypeError(f"messages must be a non-empty list of {{'role', 'content'}} dicts (one conversation) "
                                f"or a list of such lists, got {type(messages).__name__} {messages!r}")
        _check_tools(tools)
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        check_request_kwargs("chat", len(conversations), lora_request=lora_request,
                             mm_processor_kwargs=mm_processor_kwargs)
        chat_template = resolve_chat_template(chat_template)
        _check_template_kwargs(chat_template_kwargs)
        tokenizer = self.llm_engine.tokenizer
        if chat_template is None and not getattr(tokenizer, "chat_template", None):
            raise UserInputError(f"tokenizer of {self.llm_engine.model_config.model!r} has no chat template")
        prompts, texts = [], []
        for n, conversation in enumerate(conversations):
            _check_conversation(n, conversation)
            conversation = [_template_message(m, f"conversation {n} message {i}", content_format)
                            for i, m in enumerate(conversation)]
            try:
                text = render_chat(tokenizer, list(conversation), chat_template=chat_template, tools=tools,
                                   add_generation_prompt=add_generation_prompt,
                                   continue_final_message=continue_final_message,
                                   chat_template_kwargs=chat_template_kwargs)
            except UserInputError as e:
                raise UserInputError(f"conversation {n}: {e}") from None
            # The template already wrote the special tokens (BOS etc.); do not add them twice.
            text = check_unicode(text, f"conversation {n}")
            prompts.append(list(tokenizer.encode(text, add_special_tokens=False)))
            texts.append(text)
        outputs = self.generate(prompts, sampling_params, use_tqdm=use_tqdm)
        for output, text in zip(outputs, texts):  # token ids went in; report the text they came from
            output.prompt = text
        return outputs


def _check_generation_config(generation_config) -> str:
    """`generation_config` as a string (a path-like folder too), checked before the model loads: UserTypeError
    unless a non-empty string, the errors of `check_generation_config` for a folder without a usable
    generation_config.json."""
    if isinstance(generation_config, os.PathLike):
        generation_config = os.fspath(generation_config)
    if not isinstance(generation_config, str) or not generation_config:
        raise UserTypeError(f"generation_config={generation_config!r} must be 'auto' (the model's "
                            "generation_config.json), 'vllm' (no defaults) or a folder holding a "
                            "generation_config.json")
    check_generation_config(generation_config)
    return generation_config


def _check_template_kwargs(chat_template_kwargs) -> None:
    if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
        raise UserTypeError(f"chat_template_kwargs must be a dict, got {type(chat_template_kwargs).__name__} "
                            f"{chat_template_kwargs!r:.80}")


def _check_tools(tools) -> None:
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise UserTypeError(f"tools must be a list of OpenAI tool dicts, got {tools!r}")
    for i, tool in enumerate(tools or ()):  # as the server's schema checks them: a template renders what it gets
        function = tool.get("function")
        if tool.get("type") != "function" or not isinstance(function, dict) \
                or not isinstance(function.get("name"), str) or not function["name"]:
            raise UserInputError(f"tools[{i}]={tool!r:.120}: expected {{'type': 'function', 'function': "
                                 "{'name': ..., 'parameters': {...}}}")


def _check_conversation(n: int, conversation) -> None:
    if not isinstance(conversation, (list, tuple)):
        raise UserTypeError(f"conversation {n}: {conversation!r} must be a list of message dicts")
    for i, message in enumerate(conversation):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) \
                or not (message.get("content") is not None or message.get("tool_calls")):
            raise UserInputError(f"conversation {n} message {i}: {message!r} must be a dict with a "
                                 f"string 'role' and a 'content' that is not None (or 'tool_calls')")
        check_role(message["role"], f"conversation {n} message {i}")
        content = message.get("content")
        if content is not None and not isinstance(content, str) and not (
                isinstance(content, list) and all(isinstance(part, dict) for part in content)):
            raise UserTypeError(f"conversation {n} message {i}: content={content!r} must be a string or a list "
                                f"of content parts ({{'type': 'text', 'text': ...}} dicts)")


def _template_message(message: dict, where: str, content_format: str = "string") -> dict:
    """A message as the server gives it to the chat template: text parts joined ("string"), or, for "openai",
    kept as a list of text parts (a string content becomes one part); an assistant turn of only tool calls gets
    content "" (templates read message['content']); an assistant turn's reasoning goes under both of vLLM's names
    (`with_reasoning`)."""
    message = with_reasoning(message)
    content = message.get("content")
    if content is None:
        return dict(message, content="")
    return dict(message, content=as_content_format(content, content_format, where))


def _per_prompt(sampling_params, num: int) -> list[SamplingParams]:
    """One SamplingParams per prompt. TypeError naming the type of anything else (a dict included:
    build ``SamplingParams(**d)``); ValueError when a list's length is not `num`."""
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * num
    if not isinstance(sampling_params, (list, tuple)):
        raise UserTypeError(f"sampling_params must be a SamplingParams or a list of them, got "
                            f"{type(sampling_params).__name__} {sampling_params!r}")
    for i, p in enumerate(sampling_params):
        if not isinstance(p, SamplingParams):
            raise UserTypeError(f"sampling_params[{i}] must be a SamplingParams, got {type(p).__name__} {p!r}")
    if len(sampling_params) != num:
        raise UserInputError(f"got {len(sampling_params)} sampling_params for {num} prompts; expected one or {num}")
    return list(sampling_params)


def _prompt_list(prompts) -> list:
    """One prompt (text, token ids, or vLLM's TextPrompt / TokensPrompt dict) or a list of them -> a list of
    texts / token-id lists (a dict with a ``cache_salt`` kept as it is). UserTypeError for another type, UserInputError for a dict with neither key."""
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, (list, tuple)) and prompts
                                            and isinstance(prompts[0], int)):
        prompts = [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise UserTypeError(f"prompts={prompts!r} must be a string, a list of token ids, or a list of those")
    for i, p in enumerate(prompts):
        if isinstance(p, dict) and not {"prompt", "prompt_token_ids"} & p.keys():
            raise UserInputError(f"prompt {i}: {p!r} has neither 'prompt' nor 'prompt_token_ids'")
        if isinstance(p, dict) and p.get("multi_modal_data") is not None:  # not dropped silently
            raise UserInputError(f"prompt {i}: multi_modal_data is not supported: the engine serves text-only "
                                 "decoder models")
        ids = p.get("prompt_token_ids") if isinstance(p, dict) else None
        if ids is not None and not isinstance(ids, (list, tuple)):  # a string here is no text prompt
            hint = " (convert it with .tolist())" if hasattr(ids, "tolist") else ""
            raise UserTypeError(f"prompt {i}: prompt_token_ids must be a list of token ids (ints), got "
                                f"{type(ids).__name__} {ids!r:.60}{hint}")
    # a dict with a cache_salt goes to the engine as it is (the salt is part of the request)
    return [p.get("prompt_token_ids", p.get("prompt")) if isinstance(p, dict) and "cache_salt" not in p else p
            for p in prompts]


def _item_names(name: str, data) -> list[str]:
    """How a score call's error names the items of one side: `name[i]` for a list of prompts, `name` for one."""
    if isinstance(data, (list, tuple)) and not (data and isinstance(data[0], int)):
        return [f"{name}[{i}]" for i in range(len(data))]
    return [name]
