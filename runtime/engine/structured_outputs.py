"""Structured outputs: vLLM's `StructuredOutputsParams`, compiled and enforced with xgrammar.

A request names one constraint (a JSON schema, any JSON object, a regex, a list of choices or an EBNF
grammar). `StructuredOutputManager.compile` turns it into an xgrammar `CompiledGrammar` (cached by
xgrammar's compiler, so checking a request in the server and admitting it in the engine compile once);
each sequence then gets its own `GrammarMatcher`. Before a step samples, `fill_bitmask` writes one row of
allowed tokens per constrained sequence (a packed int32 bitmask, 32 tokens per word, as xgrammar lays it
out) into pinned host memory and sends it to the device without waiting; the sampler masks the logits
there (`Sampler` `_apply_bitmask`). After the token comes back, `accept` advances the matcher.

Why xgrammar: it is what vLLM uses by default, it is maintained by the MLC team with releases every
few weeks, installs from wheels on CPU and CUDA machines alike, and precomputes per-state token masks
(an adaptive token-mask cache), so filling a row costs microseconds for most JSON states
(Dong et al., "XGrammar", 2024).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import torch

_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """One output constraint (vLLM's names). Exactly one of json, regex, choice, grammar, json_object.

    json: a JSON schema (a dict or its JSON text); regex: a regular expression the whole output matches;
    choice: the output is exactly one of these strings; grammar: an EBNF (GBNF) grammar with a `root`
    rule; json_object: any JSON object. disable_any_whitespace: JSON without free whitespace between
    tokens (compact output). ValueError from the constructor when not exactly one is given.
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"StructuredOutputsParams: exactly one of {', '.join(_KINDS)} must be set, "
                             f"got {given or 'none'}")
        if self.choice is not None and (not isinstance(self.choice, (list, tuple)) or not self.choice
                                        or not all(isinstance(c, str) for c in self.choice)):
            raise ValueError(f"StructuredOutputsParams: choice={self.choice!r} must be a non-empty list of strings")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"StructuredOutputsParams: {name}={value!r} must be a string")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError(f"StructuredOutputsParams: json={self.json!r} must be a JSON schema (dict or JSON text)")

    @property
    def kind(self) -> str:
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))


def choice_grammar(choices: list[str]) -> str:
    """EBNF accepting exactly one of `choices` (JSON string escapes are valid EBNF literal escapes)."""
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


def _clean(message: str) -> str:
    """xgrammar's message without its C++ log prefix ("[12:00:00] /project/cpp/x.cc:12: ")."""
    message = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", message.strip())
    return message.removeprefix("Check failed: (error.empty()) is false: ")


class StructuredOutputManager:
    """Compiles constraints for one tokenizer and keeps one matcher per constrained sequence.

    Args:
        tokenizer: the Hugging Face tokenizer of the model.
        vocab_size: the number of logits (rows of the LM head; may exceed len(tokenizer)).
        eos_token_ids: tokens that end a completion (the grammar's stop tokens).
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: set[int]):
        import xgrammar as xgr  # optional dependency (the serve extra): only constrained requests need it

        self._xgr = xgr
        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=sorted(eos_token_ids))
        self.compiler = xgr.GrammarCompiler(info, max_threads=4, cache_enabled=True)
        self.matchers: dict[int, Any] = {}
        """seq_id -> xgrammar GrammarMatcher."""

    def compile(self, params: StructuredOutputsParams):
        """The CompiledGrammar of `params`; ValueError naming the constraint and xgrammar's complaint."""
        kind = params.kind
        try:
            if kind == "json":
                schema = params.json if isinstance(params.json, str) else json.dumps(params.json)
                return self.compiler.compile_json_schema(schema, any_whitespace=not params.disable_any_whitespace)
            if kind == "json_object":  # any object (as a schema, so disable_any_whitespace applies)
                return self.compiler.compile_json_schema('{"type": "object"}',
                                                         any_whitespace=not params.disable_any_whitespace)
            if kind == "regex":
                return self.compiler.compile_regex(params.regex)
            if kind == "choice":
                return self.compiler.compile_grammar(choice_grammar(params.choice))
            return self.compiler.compile_grammar(params.grammar)
        except Exception as e:  # xgrammar raises RuntimeError / InvalidJSONError with the parser's message
            raise ValueError(f"invalid {kind} for structured outputs: {_clean(str(e))}") from None

    def add(self, seq_id: int, compiled) -> None:
        self.matchers[seq_id] = self._xgr.GrammarMatcher(compiled)

    def remove(self, seq_id: int) -> None:
        self.matchers.pop(seq_id, None)

    def accept(self, seq_id: int, token_id: int) -> bool:
        """Advance the sequence's matcher by `token_id`; True once its grammar is complete (terminated)."""
        matcher = self.matchers.get(seq_id)
        if matcher is None:
            return False
        if not matcher.accept_token(token_id):
            raise RuntimeError(f"sequence {seq_id}: token {token_id} violates its grammar (a sampler bug)")
        return matcher.is_terminated()

    def fill_bitmask(self, seq_ids: list[int], device: torch.device):
        """(bitmask [R, ceil(V/32)] int32 on `device`, rows [R] int64 on `device`) for the constrained
        sequences among `seq_ids` (rows index `seq_ids`), or None when none is constrained. The device
        copies do not wait for the device."""
        rows = [i for i, sid in enumerate(seq_ids) if sid in self.matchers]
        if not rows:
            return None
        xgr = self._xgr
        bitmask = xgr.allocate_token_bitmask(len(rows), self.vocab_size)
        for r, i in enumerate(rows):
            matcher = self.matchers[seq_ids[i]]
            if not matcher.is_terminated():
                matcher.fill_next_token_bitmask(bitmask, r)
        rows_t = torch.tensor(rows, dtype=torch.int64)
        if device.type == "cuda":
            return bitmask.pin_memory().to(device, non_blocking=True), rows_t.pin_memory().to(device, non_blocking=True)
        return bitmask, rows_t
