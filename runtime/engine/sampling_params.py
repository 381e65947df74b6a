"""Per-request sampling settings, named and defaulted like vLLM's `SamplingParams`."""

from __future__ import annotations

import copy
import enum
import math
from dataclasses import dataclass, field
from numbers import Integral, Real

from fxrewrite.errors import UserInputError, UserTypeError, is_integer

from fxrewrite.runtime.engine.structured_outputs import StructuredOutputsParams
from fxrewrite.runtime.engine_config import SEED_RANGE

_GREEDY_EPS = 1e-5
# The sampler computes in float32: a larger value would become inf there (logits / inf is NaN).
_FLOAT32_MAX = 3.4028234663852886e38
_LOGIT_BIAS_RANGE = (-100.0, 100.0)  # OpenAI's
# Wider than any useful penalty; beyond it a float32 logit divided or multiplied by it (then divided by a
# temperature down to 1e-5) can overflow to inf, and a row holding two infs samples from NaN.
_REPETITION_PENALTY_RANGE = (1e-9, 1e9)
_NUMBERS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
_INTEGERS = ("n", "top_k", "min_tokens")
_BOOLEANS = ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens",
             "detokenize")
_OPTIONAL_INTEGERS = ("max_tokens", "logprobs", "prompt_logprobs", "seed", "truncate_prompt_tokens")  # None allowed


class RequestOutputKind(enum.IntEnum):
    """What each `RequestOutput` of a request carries (vLLM's enum, same names and values)."""

    CUMULATIVE = 0
    """Everything so far (text, token ids, logprobs), every step the request progressed."""
    DELTA = 1
    """Only what is new since the request's previous output (prompt logprobs in the first one only), every step
    it progressed: a step's cost does not grow with the output's length."""
    FINAL_ONLY = 2
    """One output, when the request finishes (what `LLM.generate` asks for)."""


@dataclass
class SamplingParams:
    """How one request is sampled and when it stops.

    Every field keeps vLLM's name and meaning. A temperature below 1e-5 means greedy (argmax).
    Raises TypeError from the constructor for a value of the wrong type and ValueError for an
    out-of-range one, each naming the field, the value and what was expected.
    """

    n: int = 1
    """Number of independent completions for the prompt."""
    temperature: float = 1.0
    """Logits are divided by it; 0 means greedy. At most float32's largest value (3.4028234663852886e38)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability sums to >= top_p, in (0, 1]."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 or -1 keeps all."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the top token's, in [0, 1]."""
    seed: int | None = None
    """Seed of this request's own torch.Generator: the same seed gives the same tokens."""
    presence_penalty: float = 0.0
    """Subtracted once from the logit of every token already generated, in [-2, 2]."""
    frequency_penalty: float = 0.0
    """Subtracted per occurrence from the logit of every token already generated, in [-2, 2]."""
    repetition_penalty: float = 1.0
    """CTRL-style: logits of prompt or generated tokens divided (if > 0) or multiplied by it; in [1e-9, 1e9]."""
    stop: list[str] | str | None = None
    """Strings that end the completion; the text is cut right before the first one."""
    stop_token_ids: list[int] | None = None
    """Token ids that end the completion (kept in token_ids, like EOS)."""
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    """Most tokens to generate, at least 1; None means up to max_model_len (or to what the KV cache holds, when
    that is less: `LLMEngine.max_seq_len`). Generation always stops at
    max_model_len tokens (prompt + output) with finish_reason "length", so a larger value is capped there,
    as in vLLM's offline API (the OpenAI server answers 400 for an explicit one, as vLLM's does)."""
    min_tokens: int = 0
    """EOS and stop_token_ids are masked until this many tokens were generated."""
    logprobs: int | None = None
    """Number of top logprobs to return per generated token (the sampled one is always included); -1: every token
    of the vocabulary (vLLM's; the engine's max_logprobs must allow it, -1 there too)."""
    prompt_logprobs: int | None = None
    """Number of top logprobs to return per prompt token (the prompt's own token always included);
    the first prompt token has none; -1 as for logprobs. A request asking for it skips the prefix cache."""
    truncate_prompt_tokens: int | None = None
    """vLLM's: keep only the prompt's last k tokens (-1: the last max_model_len); at most max_model_len."""
    logit_bias: dict[int, float] | None = None
    """{token_id: bias} added to the logits before sampling (OpenAI's logit_bias, each bias in [-100, 100])."""
    allowed_token_ids: list[int] | None = None
    """Only these token ids may be sampled (vLLM's field; every other logit is -inf before sampling)."""
    bad_words: list[str] | None = None
    """Words never generated: a word's last token is banned whenever the tokens before it were just
    generated (each word tokenized with and without a leading space, as vLLM does)."""
    structured_outputs: StructuredOutputsParams | None = None
    """A JSON schema, regex, choice list or grammar every completion must follow (xgrammar). With min_tokens,
    allowed_token_ids or bad_words, a step where they forbid every token the grammar allows samples from the grammar
    alone (the grammar wins; e.g. EOS before min_tokens once the grammar is complete)."""
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    detokenize: bool = True
    """False: outputs carry token ids only (text "", logprob entries without decoded_token), as vLLM's
    field; RL rollouts and token-level evaluation skip the per-token decoding. Stop strings need it."""
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    """What each RequestOutput of `LLMEngine.step` carries (`RequestOutputKind`)."""
    stop_strings: list[str] = field(init=False, repr=False)
    _bad_words_token_ids: tuple[tuple[str, ...], list[list[int]]] | None = field(
        default=None, init=False, repr=False, compare=False)
    """(the words, their token ids) from `update_from_tokenizer`: the words are kept so a later edit is noticed."""

    def __post_init__(self) -> None:
        if self.stop is not None and not isinstance(self.stop, str) and not (
                isinstance(self.stop, (list, tuple)) and all(isinstance(x, str) for x in self.stop)):
            raise UserTypeError(f"SamplingParams: stop={self.stop!r} must be a string or a list of strings")
        self.stop_strings = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if isinstance(self.stop_token_ids, (str, bytes)):
            raise UserTypeError(f"SamplingParams: stop_token_ids={self.stop_token_ids!r} must be a list of integers")
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._check_types()
        self._check()

    def _check_types(self) -> None:
        for name in _NUMBERS + _INTEGERS + _OPTIONAL_INTEGERS:
            value = getattr(self, name)
            kind = Real if name in _NUMBERS else Integral
            if isinstance(value, kind) and not isinstance(value, bool):
                if kind is Real and not math.isfinite(value):
                    raise UserInputError(f"SamplingParams: {name}={value!r} must be a finite number")
                continue
            if value is None and name in _OPTIONAL_INTEGERS:
                continue
            expected = "a number" if kind is Real else "an integer"
            raise UserTypeError(f"SamplingParams: {name}={value!r} must be {expected}")
        if not all(is_integer(t) for t in self.stop_token_ids):
            raise UserTypeError(f"SamplingParams: stop_token_ids={self.stop_token_ids!r} must be a list of integers")
        self._check_extras()

    def _check_extras(self) -> None:
        if self.logit_bias is not None:
            low, high = _LOGIT_BIAS_RANGE
            if not isinstance(self.logit_bias, dict) or not all(
                    is_integer(t) and t >= 0 and isinstance(b, Real) and low <= b <= high
                    for t, b in self.logit_bias.items()):  # NaN fails the range check too
                raise UserTypeError(f"SamplingParams: logit_bias={self.logit_bias!r} must map token ids "
                                    f"(integers >= 0) to numbers in [{low:g}, {high:g}]")
            self.logit_bias = {int(t): float(b) for t, b in self.logit_bias.items()}
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if not (isinstance(ids, (list, tuple)) and ids and all(
                    is_integer(t) and t >= 0 for t in ids)):
                raise UserTypeError(f"SamplingParams: allowed_token_ids={ids!r} must be a non-empty list of token ids "
                                    "(integers >= 0)")
            self.allowed_token_ids = [int(t) for t in ids]
        if self.bad_words is not None and not (
                isinstance(self.bad_words, (list, tuple)) and all(isinstance(w, str) and w for w in self.bad_words)):
            raise UserTypeError(f"SamplingParams: bad_words={self.bad_words!r} must be a list of non-empty strings")
        if isinstance(self.output_kind, bool) or self.output_kind not in tuple(RequestOutputKind):
            raise UserTypeError(f"SamplingParams: output_kind={self.output_kind!r} must be a RequestOutputKind "
                                "(CUMULATIVE, DELTA or FINAL_ONLY)")
        self.output_kind = RequestOutputKind(self.output_kind)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise UserTypeError(f"SamplingParams: structured_outputs={self.structured_outputs!r} must be a "
                            "StructuredOutputsParams")

    def _check(self) -> None:
        checks = [
            (self.n >= 1, "n", self.n, "at least 1"),
            (0 <= self.temperature <= _FLOAT32_MAX, "temperature", self.temperature,
             f"in [0, {_FLOAT32_MAX!r}] (the sampler divides float32 logits by it)"),
            (0 < self.top_p <= 1, "top_p", self.top_p, "in (0, 1]"),
            (self.top_k >= 0, "top_k", self.top_k, "-1, 0 (disabled) or a positive integer"),
            (0 <= self.min_p <= 1, "min_p", self.min_p, "in [0, 1]"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty", self.presence_penalty, "in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty", self.frequency_penalty, "in [-2, 2]"),
            (_REPETITION_PENALTY_RANGE[0] <= self.repetition_penalty <= _REPETITION_PENALTY_RANGE[1],
             "repetition_penalty", self.repetition_penalty,
             "in [{:g}, {:g}] (float32 logits are divided or multiplied by it)".format(*_REPETITION_PENALTY_RANGE)),
            (self.max_tokens is None or self.max_tokens >= 1, "max_tokens", self.max_tokens, "at least 1"),
            (self.min_tokens >= 0, "min_tokens", self.min_tokens, "at least 0"),
            (self.logprobs is None or self.logprobs >= -1, "logprobs", self.logprobs,
             "-1 (the whole vocabulary) or at least 0"),
            (self.prompt_logprobs is None or self.prompt_logprobs >= -1, "prompt_logprobs", self.prompt_logprobs,
             "-1 (the whole vocabulary) or at least 0"),
            (self.truncate_prompt_tokens in (None, -1) or self.truncate_prompt_tokens >= 1, "truncate_prompt_tokens",
             self.truncate_prompt_tokens, "-1 or at least 1"),
            (self.seed is None or SEED_RANGE[0] <= self.seed <= SEED_RANGE[1], "seed", self.seed,
             f"in [{SEED_RANGE[0]}, {SEED_RANGE[1]}]"),
            (all(t >= 0 for t in self.stop_token_ids), "stop_token_ids", self.stop_token_ids,
             "token ids of at least 0"),
        ]
        for ok, name, value, expected in checks:
            if not ok:
                raise UserInputError(f"SamplingParams: {name}={value!r} must be {expected}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise UserInputError(
                f"SamplingParams: min_tokens={self.min_tokens} must be at most max_tokens={self.max_tokens}"
            )
        if any(not s for s in self.stop_strings):
            raise UserInputError(f"SamplingParams: stop={self.stop!r} must not contain empty strings")
        for name in _BOOLEANS:
            if not isinstance(getattr(self, name), bool):
                raise UserTypeError(f"SamplingParams: {name}={getattr(self, name)!r} must be a bool")
        if self.stop_strings and not self.detokenize:
            raise UserInputError(f"SamplingParams: stop={self.stop!r} needs detokenize=True (stop strings are "
                                 "found in the decoded text)")

    def clone(self) -> SamplingParams:
        """A deep copy (vLLM's ``SamplingParams.clone``): change it without touching this one (the engine checks
        the changed fields when the request is added, `verify`)."""
        return copy.deepcopy(self)

    def verify(self) -> None:
        """Check every field again and re-derive what is derived from them (``stop_strings``): the engine calls it
        for each request, so a field set after construction (a clone edited) is checked and takes effect. The
        constructor's errors (ValueError / TypeError naming the field)."""
        self.__post_init__()

    def update_from_tokenizer(self, tokenizer) -> None:
        """vLLM's: tokenize bad_words now, so that adding the request does not (the server calls it in its tokenizer
        thread: thousands of words take a second or more, which must not stall the event loop)."""
        words = tuple(self.bad_words or ())
        self._bad_words_token_ids = (words, bad_words_token_ids(tokenizer, words))

    def bad_words_token_ids(self, tokenizer) -> list[list[int]]:
        """bad_words as token ids: `update_from_tokenizer`'s, when it saw the current words, else tokenized now."""
        words = tuple(self.bad_words or ())
        if self._bad_words_token_ids is not None and self._bad_words_token_ids[0] == words:
            return self._bad_words_token_ids[1]
        return bad_words_token_ids(tokenizer, words)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def changes_logits(self) -> bool:
        """Whether logit_bias, allowed_token_ids or bad_words edit this request's logits before sampling (the sampler's
        per-row pass; a grammar's bitmask is applied separately, batched)."""
        return bool(self.logit_bias) or bool(self.bad_words) or self.allowed_token_ids is not None

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1.0
        )


def bad_words_token_ids(tokenizer, words) -> list[list[int]]:
    """Each bad word's token ids, tokenized alone and after a space (vLLM's two forms), deduplicated."""
    out: list[list[int]] = []
    seen: set[tuple[int, ...]] = set()  # not `ids in out`: quadratic in the words (5,000 took over a second)
    for word in words:
        for text in (word, " " + word.lstrip()):
            ids = list(tokenizer.encode(text, add_special_tokens=False))
            if ids and tuple(ids) not in seen:
                seen.add(tuple(ids))
                out.append(ids)
    return out
