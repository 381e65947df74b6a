"""Structured outputs: vLLM's `StructuredOutputsParams`, compiled and enforced with xgrammar.

A request names one constraint (a JSON schema, any JSON object, a regex, a list of choices or an EBNF
grammar). `StructuredOutputManager.compile` turns it into an xgrammar `CompiledGrammar` (cached by
xgrammar's compiler, so checking a request in the server and admitting it in the engine compile once);
each sequence then gets its own `GrammarMatcher`. Per step the host work is two batched xgrammar calls,
no Python loop over matchers: after a step's tokens come back, `accept_tokens` advances every constrained
matcher at once (`BatchGrammarMatcher.batch_accept_token`); once the next step's forward is launched,
`fill_bitmask` writes one row of allowed tokens per sampling sequence (a packed int32 bitmask, 32 tokens
per word, xgrammar's layout; all ones for unconstrained rows) into a reused pinned host buffer with
xgrammar's thread pool (`batch_fill_next_token_bitmask`) and copies it to the device without waiting,
so the fill overlaps the forward pass; the sampler masks the logits in place there with one kernel
(`Sampler`, `apply_token_bitmask`). Sequences without a grammar cost one dict lookup per step.

Why xgrammar: it is what vLLM uses by default, it is maintained by the MLC team with releases every
few weeks, installs from wheels on CPU and CUDA machines alike, and precomputes per-state token masks
(an adaptive token-mask cache), so filling a row costs microseconds for most JSON states
(Dong et al., "XGrammar", 2024).
"""

from __future__ import annotations

import json
import os
import re
import time
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
        max_threads: threads of xgrammar's batched fill (default: half the cores, at most 8).
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: set[int], max_threads: int | None = None):
        import xgrammar as xgr  # optional dependency (the serve extra): only constrained requests need it

        self._xgr = xgr
        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=sorted(eos_token_ids))
        self.compiler = xgr.GrammarCompiler(info, max_threads=4, cache_enabled=True)
        self._stop_ids = frozenset(eos_token_ids)
        threads = max_threads or min(8, max(1, (os.cpu_count() or 2) // 2))
        self._batch = xgr.BatchGrammarMatcher(threads)
        self._buffers = _PinnedBuffers(xgr.get_bitmask_shape(1, vocab_size)[1])
        self.matchers: dict[int, Any] = {}
        """seq_id -> xgrammar GrammarMatcher."""
        self.stats = {"accept_s": 0.0, "fill_s": 0.0, "steps": 0}
        """Host seconds spent in accept_tokens / fill_bitmask, and the number of fills (benchmarks)."""

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

    def accept_tokens(self, samples: list[tuple[Any, Any]]) -> set[int]:
        """Advance the matchers of the constrained sequences among `samples` ((Sequence, SampleResult)
        pairs of one step) by their tokens, in one batched call; returns the seq_ids whose grammar is now
        complete (it accepted a stop token, which is what xgrammar's `is_terminated` means).
        RuntimeError if a token violates its grammar (a sampler bug)."""
        start = time.perf_counter()
        get, matchers, picked = self.matchers.get, [], []
        for seq, result in samples:
            seq_id, token_id = seq.seq_id, result.token_id
            matcher = get(seq_id)
            if matcher is not None:
                matchers.append(matcher)
                picked.append((seq_id, token_id))
        done = set()
        if matchers:
            accepted = self._xgr.BatchGrammarMatcher.batch_accept_token(matchers, [t for _, t in picked])
            for ok, (seq_id, token_id) in zip(accepted, picked):
                if not ok:
                    raise RuntimeError(f"sequence {seq_id}: token {token_id} violates its grammar (a sampler bug)")
                if token_id in self._stop_ids:
                    done.add(seq_id)
        self.stats["accept_s"] += time.perf_counter() - start
        return done

    def fill_bitmask(self, seq_ids: list[int], device: torch.device) -> torch.Tensor | None:
        """The allowed tokens of the sequences `seq_ids` (row i for seq_ids[i]) as a packed bitmask
        [len(seq_ids), ceil(V/32)] int32 on `device`, all ones in the rows of unconstrained sequences;
        None when none is constrained. The copy to the device does not wait for it."""
        start = time.perf_counter()
        get, matchers, rows = self.matchers.get, [], []
        for i, seq_id in enumerate(seq_ids):
            matcher = get(seq_id)
            if matcher is not None:
                matchers.append(matcher)
                rows.append(i)
        if not matchers:
            return None
        host, event = self._buffers.next(len(seq_ids), device)
        if len(rows) < len(seq_ids):
            host.fill_(-1)  # every token allowed
        self._batch.batch_fill_next_token_bitmask(matchers, host, rows)
        out = host
        if device.type == "cuda":
            out = host.to(device, non_blocking=True)
            event.record()
        self.stats["fill_s"] += time.perf_counter() - start
        self.stats["steps"] += 1
        return out


class _PinnedBuffers:
    """Two host bitmask buffers used in turn (pinned when CUDA is there), each with the CUDA event of its
    last copy to the device: a buffer is refilled only after that copy ran, without a device sync."""

    def __init__(self, width: int):
        self.width = width
        self._slots: list[list] = [[None, None], [None, None]]
        self._turn = 0

    def next(self, rows: int, device: torch.device):
        slot = self._slots[self._turn]
        self._turn ^= 1
        if slot[0] is None or slot[0].shape[0] < rows:
            capacity = max(rows, 64)
            with torch.inference_mode(False):  # a normal tensor: refilled in place in and out of inference mode
                slot[0] = torch.empty((capacity, self.width), dtype=torch.int32,
                                      pin_memory=device.type == "cuda")
            slot[1] = torch.cuda.Event() if device.type == "cuda" else None
        elif slot[1] is not None:
            slot[1].synchronize()  # its previous copy was queued a step ago: done in practice
        return slot[0][:rows], slot[1]
