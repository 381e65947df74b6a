"""What completions and chat share: model-name check, prompt length check, sampling parameters.

`OpenAIServing` holds the async engine, the served names and the tokenizer; `serving_completion`
and `serving_chat` subclass it. Every user error raises `OpenAIError` (400/404) before anything is
allocated in the engine.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

from fxrewrite.errors import UserInputError
from fxrewrite.runtime.engine.prompts import truncate_prompt
from fxrewrite.runtime.engine.sampling_params import SamplingParams
from fxrewrite.runtime.server.async_engine import EngineDeadError, StepOutput
from fxrewrite.runtime.server.async_tokenizer import AsyncTokenizer
from fxrewrite.runtime.server.errors import OpenAIError
from fxrewrite.runtime.server.prompt_bound import PromptTooLong, encode_bounded
from fxrewrite.runtime.server.protocol import SamplingRequest, random_id
from fxrewrite.runtime.server.protocol_responses import PromptTokenUsageInfo, UsageInfo
from fxrewrite.runtime.server.request_params import logit_bias_of

if TYPE_CHECKING:
    from fxrewrite.runtime.server.async_engine import AsyncLLMEngine

# Fallbacks when neither the request nor generation_config.json sets a value (OpenAI's defaults).
_SAMPLING_FALLBACKS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}



def _refused_field(message: str, sent_as: dict[str, str]) -> tuple[str, str | None]:
    """(message, param) of an engine refusal, whose message starts with the SamplingParams field ("logprobs=21 is
    more than max_logprobs=20", "structured_outputs is not supported with ..."), renamed to the request field
    that set it (`sent_as`: {params field: request field, or (request field, how the message names it)})."""
    found = re.match(r"(logprobs|prompt_logprobs|structured_outputs|bad_words|allowed_token_ids|prompt)\b", message)
    if found is None:
        return message, None
    field = found.group(1)
    param = sent_as.get(field, field)
    param, label = param if isinstance(param, tuple) else (param, param)  # (request field, how to name it)
    return label + message[len(field):], param

class OpenAIServing:
    """Shared request handling over one `AsyncLLMEngine`.

    Args:
        engine: the async engine (its `.engine.tokenizer` and `.engine.model_config` are used).
        served_model_names: names a request's `model` may carry; the first one is the default and the
            one every response carries.
        generation_defaults: default sampling values (from generation_config.json), vLLM names.
        async_tokenizer: runs prompt tokenization off the event loop (shared by the app's handlers, so
            their calls are serialised; default: one of its own over the engine's tokenizer).
    """

    def __init__(self, engine: AsyncLLMEngine, served_model_names: list[str],
                 generation_defaults: dict[str, Any] | None = None, async_tokenizer: AsyncTokenizer | None = None):
        self.engine = engine
        self.prompt_tokens_details = False
        """Usage carries prompt_tokens_details.cached_tokens (serve's --enable-prompt-tokens-details)."""
        self.served_model_names = list(served_model_names)
        self.generation_defaults = dict(generation_defaults or {})
        self.tokenizer = engine.engine.tokenizer
        self.async_tokenizer = async_tokenizer or AsyncTokenizer(self.tokenizer)
        self.max_model_len = int(engine.engine.model_config.max_model_len)
        self.max_seq_len = int(getattr(engine.engine, "max_seq_len", self.max_model_len))
        """What a request without max_tokens may fill: max_model_len, or less when the KV cache holds less."""
        self.vocab_size = int(engine.engine.model_config.vocab_size)
        """The model's vocabulary (its logits' width): the bound of prompt ids and logit_bias keys, as offline."""

    @staticmethod
    def request_ids(prefix: str, raw_request: Any, request: Any) -> tuple[str, str]:
        """(the response's id, the base of its engine requests' ids), as vLLM names a response: `prefix`-the
        X-Request-Id header, else-the body's `request_id` (vLLM's field), else-a new id. A client's id gets a random
        suffix in the engine, where ids must be unique (two requests may send the same one)."""
        given = raw_request.headers.get("x-request-id") or (request.model_extra or {}).get("request_id")
        if not isinstance(given, str) or not given:
            new = random_id(prefix)
            return new, new
        return f"{prefix}-{given}", random_id(f"{prefix}-{given}")

    def with_cached_tokens(self, usage: UsageInfo, cached_tokens: int) -> UsageInfo:
        """`usage` with prompt_tokens_details.cached_tokens (the prompt tokens read from the prefix cache) when
        --enable-prompt-tokens-details is on and some were, as vLLM reports them."""
        if self.prompt_tokens_details and cached_tokens:
            usage.prompt_tokens_details = PromptTokenUsageInfo(cached_tokens=cached_tokens)
        return usage

    def top_count(self, n: int) -> int:
        """How many top logprobs a response shows for a request's count `n`: -1 (vLLM's "the whole vocabulary") is
        the vocabulary size; the engine resolves it the same way (`whole_vocabulary_logprobs`)."""
        return self.vocab_size if n == -1 else n

    def model_name(self, requested: str | None) -> str:
        """The name a response carries: the first served name, whichever served name (or none) the request
        gave, as vLLM's `OpenAIServingModels.model_name()`; 404 for a name this server does not serve."""
        if requested is not None and requested not in self.served_model_names:
            raise OpenAIError(HTTPStatus.NOT_FOUND, f"The model `{requested}` does not exist; this server serves "
                              f"{', '.join(map(repr, self.served_model_names))}", param="model", code="model_not_found")
        return self.served_model_names[0]

    def check_token_ids(self, token_ids: list[int], param: str = "prompt") -> list[int]:
        """`token_ids` when each is in [0, vocab); else a 400 naming `param` (the request field)."""
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise OpenAIError(HTTPStatus.BAD_REQUEST, f"{param}: token id {bad[0]} is out of range "
                              f"[0, {self.vocab_size})", param=param.split("[")[0], code="invalid_value")
        return token_ids

    def truncate_prompt(self, request: SamplingRequest, token_ids: list[int]) -> list[int]:
        """vLLM's `truncate_prompt_tokens`: the prompt's last k tokens (-1: the last max_model_len); a 400 for
        0 (an empty prompt) or more than max_model_len (vLLM's refusal)."""
        try:
            return truncate_prompt(token_ids, request.truncate_prompt_tokens, self.max_model_len)
        except UserInputError as e:
            raise OpenAIError(HTTPStatus.BAD_REQUEST, str(e), param="truncate_prompt_tokens",
                              code="invalid_value") from None

    def prompt_too_long(self, request: SamplingRequest, count: str) -> OpenAIError:
        """The 400 for a prompt of `count` tokens (a number, or "more than N") that leaves no room to generate."""
        return OpenAIError(
            HTTPStatus.BAD_REQUEST,
            f"This model's maximum context length is {self.max_model_len} tokens. However, your prompt has "
            f"{count} tokens, which leaves no room for the completion (at least 1 token). Please "
            f"reduce the length of the prompt{_truncate_hint(request, self.max_model_len)}.",
            param="messages" if hasattr(request, "messages") else "prompt", code="context_length_exceeded")

    def encode_prompt(self, request: SamplingRequest, text: str, **kwargs) -> list[int]:
        """`text`'s token ids (call it in the tokenizer thread); a very long text proven over max_model_len is
        refused before it is tokenized whole (`encode_bounded`: the 400 says "more than N tokens"). With
        `truncate_prompt_tokens` the whole text is tokenized (its tail is kept)."""
        if getattr(request, "truncate_prompt_tokens", None) is not None:
            return list(self.tokenizer.encode(text, **kwargs))
        try:
            return encode_bounded(self.tokenizer, text, self.max_model_len, **kwargs)
        except PromptTooLong as e:
            raise self.prompt_too_long(request, f"more than {e.at_least}") from None

    def max_tokens_for(self, request: SamplingRequest, num_prompt_tokens: int, explicit: bool) -> int:
        """The number of tokens to generate, checked against max_model_len and the KV cache (400s naming them).

        `explicit`: the request gave a limit (an over-long one is then a 400 instead of clamped). Without
        one, the rest of the context, or of the KV cache when that holds less (`LLMEngine.max_seq_len`). The
        model's generation_config `max_new_tokens` caps every request, a given limit too (vLLM's get_max_tokens
        takes the least of them).
        A limit of 0 (a completion's echo of the prompt alone) is checked as the one token the engine generates.
        """
        prompt_param = "messages" if hasattr(request, "messages") else "prompt"
        if num_prompt_tokens >= self.max_model_len:
            raise self.prompt_too_long(request, str(num_prompt_tokens))
        if num_prompt_tokens >= self.max_seq_len:  # not even one token would fit the KV cache
            raise OpenAIError(
                HTTPStatus.BAD_REQUEST,
                f"Your prompt has {num_prompt_tokens} tokens, more than the KV cache holds "
                f"({self.max_seq_len - 1}); shorten the prompt or start the server with a larger "
                "--kv-cache-memory-bytes / --gpu-memory-utilization.", param=prompt_param,
                code="context_length_exceeded")
        room = self.max_model_len - num_prompt_tokens
        limit = request.output_limit()
        cap = self.generation_defaults.get("max_tokens")  # generation_config's max_new_tokens: a ceiling (vLLM's min)
        if limit is None:
            limit, explicit = cap, False
        if not explicit:
            room = min(room, self.max_seq_len - num_prompt_tokens)
        if limit is None:
            return room
        limit = max(limit, 1)
        field = "max_completion_tokens" if getattr(request, "max_completion_tokens", None) else "max_tokens"
        if limit > room and explicit:
            raise OpenAIError(
                HTTPStatus.BAD_REQUEST,
                f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                f"requested {num_prompt_tokens + limit} tokens ({num_prompt_tokens} in the prompt, "
                f"{limit} for the completion). Please reduce the length of the prompt or {field}.",
                param=field, code="context_length_exceeded")
        if explicit and num_prompt_tokens + limit > self.max_seq_len:  # the engine would refuse it (a short KV cache)
            raise OpenAIError(
                HTTPStatus.BAD_REQUEST,
                f"The KV cache holds {self.max_seq_len - 1} tokens, so a request may total {self.max_seq_len} "
                f"(the last generated token is not cached). However, you requested {num_prompt_tokens + limit} "
                f"tokens ({num_prompt_tokens} in the prompt, {limit} for the completion). Please reduce {field} "
                "or the length of the prompt, or start the server with a larger --kv-cache-memory-bytes / "
                "--gpu-memory-utilization.", param=field, code="context_length_exceeded")
        return min(limit, room, cap or limit)

    def sampling_params(self, request: SamplingRequest, max_tokens: int, logprobs: int | None,
                        prompt_logprobs: int | None = None, structured_outputs=None):
        """The engine's `SamplingParams` for a request (400 when the engine refuses a value).

        With best_of > n, best_of completions are generated (with their logprobs, to rank them)."""
        n = request.n
        if request.best_of is not None and request.best_of > request.n:
            n = request.best_of
            logprobs = 0 if logprobs is None else logprobs
        if prompt_logprobs is None:
            prompt_logprobs = request.prompt_logprobs
        if request.min_tokens > max_tokens:  # an explicit max_tokens below it is the protocol's 400 already
            raise OpenAIError(HTTPStatus.BAD_REQUEST, f"min_tokens ({request.min_tokens}) is more than the "
                              f"{max_tokens} tokens this request may generate (what is left of the context or the "
                              "KV cache, or the model's generation_config max_new_tokens, which caps every request)",
                              param="min_tokens", code="invalid_value")
        values = {}
        for name, fallback in _SAMPLING_FALLBACKS.items():
            given = getattr(request, name)
            values[name] = given if given is not None else self.generation_defaults.get(name, fallback)
        try:
            return SamplingParams(
                n=n, seed=request.seed, stop=request.stop, prompt_logprobs=prompt_logprobs,
                logit_bias=logit_bias_of(request, self.vocab_size), bad_words=request.bad_words,
                structured_outputs=structured_outputs,
                presence_penalty=request.presence_penalty or 0.0,
                frequency_penalty=request.frequency_penalty or 0.0,
                ignore_eos=request.ignore_eos, min_tokens=request.min_tokens,
                stop_token_ids=request.stop_token_ids and self.check_token_ids(
                    request.stop_token_ids, "stop_token_ids"),
                allowed_token_ids=request.allowed_token_ids and self.check_token_ids(
                    request.allowed_token_ids, "allowed_token_ids"),
                include_stop_str_in_output=request.include_stop_str_in_output,
                skip_special_tokens=request.skip_special_tokens,
                spaces_between_special_tokens=request.spaces_between_special_tokens,
                max_tokens=max_tokens, logprobs=logprobs, **values)
        except (ValueError, TypeError) as e:  # "SamplingParams: bad_words=[''] must be ...": name the field
            field = re.match(r"SamplingParams: (\w+)=", str(e))
            name = field and field.group(1)
            raise OpenAIError(HTTPStatus.BAD_REQUEST, str(e), param=name if name in type(request).model_fields else None,
                              code="invalid_value") from None

    async def check_structured_outputs(self, params, param: str = "structured_outputs") -> None:
        """Compile a request's output constraint before it is queued (400 naming the problem and
        `param`, the request field that set it); the compiled grammar is cached, so admitting the
        request does not compile it again."""
        if params.structured_outputs is None:
            return
        try:
            await asyncio.to_thread(self.engine.engine.compile_structured_outputs, params)
        except ImportError as e:
            raise OpenAIError(HTTPStatus.BAD_REQUEST, f"structured outputs need xgrammar "
                              f"(pip install 'fxrewrite[serve]'): {e}", code="unsupported") from None
        except ValueError as e:
            raise OpenAIError(HTTPStatus.BAD_REQUEST, f"{param}: {e}", param=param,
                              code="invalid_value") from None

    async def start_requests(
        self, request_id: str, prompts: list[tuple[list[int], SamplingParams]], logprobs_field: str = "logprobs",
        structured_field: str = "structured_outputs", prompt_logprobs_field: str | tuple[str, str] = "prompt_logprobs",
        prompt_field: str = "prompt", cache_salt: str | None = None,
    ) -> tuple[list[str], list[AsyncIterator[StepOutput]]]:
        """Admit one engine request per prompt (ids `request_id-i`); all or none. `logprobs_field` /
        `structured_field` / `prompt_logprobs_field` / `prompt_field`: the request fields that set
        SamplingParams.logprobs / structured_outputs / prompt_logprobs and the prompt, named in a refusal (chat's are
        ``top_logprobs``, ``messages`` and, for a forced tool call, ``tool_choice``; a completion's echo with logprobs
        sets prompt_logprobs). `cache_salt`: the request's (`request_params.request_cache_salt`), for every prompt.

        The caller must `abort_all(ids)` when done (a no-op for finished requests).
        """
        ids, streams = [], []
        await self.tokenize_bad_words({id(p): p for _, p in prompts}.values())
        try:
            for i, (token_ids, params) in enumerate(prompts):
                rid = f"{request_id}-{i}"
                prompt = token_ids if cache_salt is None else {"prompt_token_ids": token_ids, "cache_salt": cache_salt}
                streams.append(await self.engine.add_request(rid, prompt, params))
                ids.append(rid)
        except ValueError as e:
            self.abort_all(ids)
            message, param = _refused_field(str(e), {"logprobs": logprobs_field, "structured_outputs": structured_field,
                                                     "prompt_logprobs": prompt_logprobs_field,
                                                     "prompt": (prompt_field, "prompt")})
            raise OpenAIError(HTTPStatus.BAD_REQUEST, message, param=param, code="invalid_value") from None
        except EngineDeadError:  # a 503 (an OpenAIError)
            self.abort_all(ids)
            raise
        return ids, streams

    async def tokenize_bad_words(self, params_list) -> None:
        """Tokenize each SamplingParams' bad_words in the tokenizer thread (`update_from_tokenizer`), so that
        admitting the request, on the event loop, does not: 5,000 words stalled every request and /health."""
        for params in params_list:
            if getattr(params, "bad_words", None):
                await self.async_tokenizer.run(params.update_from_tokenizer, self.tokenizer)

    def abort_all(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.engine.abort(rid)


def _truncate_hint(request, max_model_len: int) -> str:
    """The truncation that leaves one token of room, for a request that truncated its prompt to the whole context."""
    if getattr(request, "truncate_prompt_tokens", None) is None:
        return ""
    return f" (truncate_prompt_tokens={max_model_len - 1} keeps room for one token)"
