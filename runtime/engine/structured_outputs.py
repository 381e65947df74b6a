"""Structured outputs: vLLM's `StructuredOutputsParams`, compiled and enforced with xgrammar.

A request names one constraint (a JSON schema, any JSON object, a regex, a list of choices or an EBNF
grammar). `StructuredOutputManager.compile` turns it into an xgrammar `CompiledGrammar` (cached by
xgrammar's compiler, so checking a request in the server and admitting it in the engine compile once);
each sequence then gets its own `GrammarMatcher`. Per step the grammar work is two batched xgrammar calls,
no Python loop over matchers: `batch_accept_token` advances every constrained matcher by the previous
step's token, then `batch_fill_next_token_bitmask` writes one row of allowed tokens per sampling sequence
(a packed int32 bitmask, 32 tokens per word, xgrammar's layout; all ones for unconstrained rows and for
grammars that just completed) into a host slot, copied to a reused device buffer without waiting; the
sampler masks the logits in place there with one kernel (`Sampler`, `apply_token_bitmask`).

Where it runs: by default in the grammar process (grammar_process.py says why not a thread), which owns
the matchers. With async scheduling the engine sends a step's job once the step's forward pass is
launched and the previous step's token ids are read (`step_bitmask`), completes the previous step on its
main thread meanwhile, and reads the answer when the step samples, at the next launch; the main thread's
part is a pickle on a pipe each way. Without the process (FXREWRITE_GRAMMAR_PROCESS=0, or a platform
without memfds) the matchers live here and the work runs on the main thread after the previous step's
completion (the sequential path).

Why xgrammar: it is what vLLM uses by default, it is maintained by the MLC team with releases every
few weeks, installs from wheels on CPU and CUDA machines alike, and precomputes per-state token masks
(an adaptive token-mask cache), so filling a row costs microseconds for most JSON states
(Dong et al., "XGrammar", 2024).
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from dataclasses import dataclass
from typing import Any

import torch

from fxrewrite.errors import UserInputError
from fxrewrite.kernels import env_choice
from fxrewrite.runtime.engine import grammar_process
from fxrewrite.runtime.engine.grammar_bitmask import STAT_KEYS, GrammarJob, MaskSlots
from fxrewrite.runtime.engine.grammar_worker import MatcherSet, choice_grammar, compile_constraint
from fxrewrite.runtime.engine.json_schema_check import unenforced_keyword
from fxrewrite.runtime.engine.lark_grammar import ebnf_grammar

logger = logging.getLogger(__name__)
__all__ = ["StructuredOutputManager", "StructuredOutputsParams", "choice_grammar", "use_grammar_process"]

_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """One output constraint (vLLM's names). Exactly one of json, regex, choice, grammar, json_object.

    json: a JSON schema (a dict or its JSON text); regex: a regular expression the whole output matches;
    choice: the output is exactly one of these strings; grammar: an EBNF (GBNF) grammar with a `root`
    rule, or a Lark grammar with a `start` rule (the common subset, converted: lark_grammar.py);
    json_object: any JSON object. disable_any_whitespace: JSON without free whitespace between tokens
    (compact output). ValueError from the constructor when not exactly one is given.
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
            raise UserInputError(f"StructuredOutputsParams: exactly one of {', '.join(_KINDS)} must be set, "
                             f"got {given or 'none'}")
        if self.choice is not None and (not isinstance(self.choice, (list, tuple)) or not self.choice
                                        or not all(isinstance(c, str) for c in self.choice)):
            raise UserInputError(f"StructuredOutputsParams: choice={self.choice!r} must be a non-empty list of strings")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise UserInputError(f"StructuredOutputsParams: {name}={value!r} must be a string")
        for name in ("json_object", "disable_any_whitespace"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):  # "yes" would count as set / as true
                raise UserInputError(f"StructuredOutputsParams: {name}={value!r} must be true or false")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise UserInputError(f"StructuredOutputsParams: json={self.json!r} must be a JSON schema (dict or JSON text)")

    @property
    def kind(self) -> str:
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    def spec(self) -> tuple:
        """(kind, value, disable_any_whitespace): what `grammar_worker.compile_constraint` takes. A JSON
        schema goes as its text: a deeply nested dict would exceed pickle's recursion limit on its way to
        the grammar process (a 900-level schema compiled, then failed there as a 500). A Lark grammar goes as
        its EBNF (UserInputError for one outside the converted subset)."""
        kind, value = self.kind, getattr(self, self.kind)
        if kind == "json" and not isinstance(value, str):
            value = json.dumps(value)
        if kind == "grammar":
            value = ebnf_grammar(value)
        return kind, value, self.disable_any_whitespace


def use_grammar_process() -> bool:
    """Whether the grammar work runs in the grammar process: FXREWRITE_GRAMMAR_PROCESS (1 or 0), else yes
    where the platform has memfds (Linux)."""
    value = env_choice("FXREWRITE_GRAMMAR_PROCESS", "unset", ("0", "1", "unset"))
    return grammar_process.supported() if value == "unset" else value == "1"


def _clean(message: str) -> str:
    """xgrammar's message without its C++ log prefix ("[12:00:00] /project/cpp/x.cc:12: ")."""
    message = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", message.strip())
    return message.removeprefix("Check failed: (error.empty()) is false: ")


_COMPILERS: dict[tuple, Any] = {}


def grammar_compiler(xgr, tokenizer: Any, vocab_size: int, stop_token_ids: set[int]):
    """xgrammar's (TokenizerInfo, GrammarCompiler) for `tokenizer` (the compiler is thread-safe and caches its
    grammars), shared by this process's engines of one tokenizer folder: the TokenizerInfo reads the whole
    vocabulary (seconds for Qwen's 151,936 tokens). Keyed by the folder, its tokenizer.json's size and mtime, the tokenizer's
    length, vocab_size and the stop ids; a tokenizer without a folder gets its own."""
    folder = getattr(tokenizer, "name_or_path", "") or ""
    path = os.path.join(folder, "tokenizer.json")
    stat = os.stat(path) if folder and os.path.isfile(path) else None
    key = (os.path.abspath(folder), stat and (stat.st_size, stat.st_mtime_ns), len(tokenizer), vocab_size,
           tuple(sorted(stop_token_ids)))
    found = _COMPILERS.get(key) if stat else None
    if found is None:
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=sorted(stop_token_ids))
        found = (info, xgr.GrammarCompiler(info, max_threads=4, cache_enabled=True))
        if stat:
            while len(_COMPILERS) >= 4:  # a few tokenizers per process at most
                _COMPILERS.pop(next(iter(_COMPILERS)))
            _COMPILERS[key] = found
    return found


class StructuredOutputManager:
    """Compiles constraints for one tokenizer and runs the matchers of the constrained sequences.

    Args:
        tokenizer: the Hugging Face tokenizer of the model.
        vocab_size: the number of logits (rows of the LM head; may exceed len(tokenizer)).
        eos_token_ids: tokens that end a completion (the grammar's stop tokens).
        max_rows: the most sequences a step samples (the engine's max_num_seqs): the shared mask rows.
        use_process: run the matchers in the grammar process (default: `use_grammar_process()`).
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: set[int], max_rows: int = 256,
                 use_process: bool | None = None):
        import xgrammar as xgr  # optional dependency (the serve extra): only constrained requests need it

        self.vocab_size = vocab_size
        self._info, self.compiler = grammar_compiler(xgr, tokenizer, vocab_size, eos_token_ids)
        self._stop_ids = frozenset(eos_token_ids)
        self._width, self._max_rows = xgr.get_bitmask_shape(1, vocab_size)[1], max_rows
        self.constrained: set[int] = set()
        """seq_ids with a grammar (their matchers live in `local` or in the grammar process)."""
        self.lost: dict[int, str] = {}
        """seq_ids whose matchers died with the grammar process -> why; the engine fails their requests
        (`take_lost`), the other sequences go on (the step that found it samples its rows unmasked)."""
        self.stats = dict.fromkeys(STAT_KEYS, 0.0)
        self._last_fill: tuple[list, list[int]] = ([], [])  # (sampling sequences, their seq_ids) of the last step
        self.process: grammar_process.GrammarProcess | None = None
        self.local: MatcherSet | None = None
        if use_grammar_process() if use_process is None else use_process:
            self._start_process()
        else:
            self.local, self._slots = MatcherSet(xgr), MaskSlots(self._width)

    def _start_process(self) -> None:
        self.process = grammar_process.GrammarProcess(self._info.serialize_json(), self._max_rows, self._width)
        self._slots = MaskSlots(self._width, self.process.slots, self.process.pin)

    def close(self) -> None:
        """End the grammar process (also done when the manager is collected)."""
        if self.process is not None:
            self.process.close()

    def compile(self, params: StructuredOutputsParams):
        """The CompiledGrammar of `params`; ValueError naming the constraint and xgrammar's complaint, or a schema
        keyword xgrammar would not enforce (`json_schema_check`)."""
        if params.kind == "json":
            schema = params.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except (ValueError, RecursionError):
                    schema = None  # xgrammar's own parse error says what is wrong
            unenforced = unenforced_keyword(schema)
            if unenforced:
                raise UserInputError(f"invalid json for structured outputs: {unenforced}")
        try:
            compiled = compile_constraint(self.compiler, *params.spec())
        except Exception as e:  # xgrammar raises RuntimeError / InvalidJSONError with the parser's message
            raise ValueError(f"invalid {params.kind} for structured outputs: {_clean(str(e))}") from None
        if not self._first_token_allowed(compiled):  # else the first step masks every token: a 500 ("sampler bug")
            raise ValueError(f"invalid {params.kind} for structured outputs: it accepts no string (no token can "
                             "start an output, and it cannot end empty; e.g. a rule defined only through itself)")
        return compiled

    def _first_token_allowed(self, compiled) -> bool:
        """Whether a fresh matcher of `compiled` allows some token (the stop tokens included) at the first step."""
        import xgrammar as xgr

        mask = xgr.allocate_token_bitmask(1, self.vocab_size)
        xgr.GrammarMatcher(compiled).fill_next_token_bitmask(mask)
        return bool(mask.any())

    def add(self, seq_id: int, params: StructuredOutputsParams, compiled=None) -> None:
        """Give `seq_id` a matcher of `params` (`compiled`: its CompiledGrammar, when already at hand). When the
        grammar process is gone (killed, say), the sequences it held are lost and a fresh process starts."""
        if self.process is None:
            self.local.add(seq_id, compiled if compiled is not None else self.compile(params))
        else:
            if not self.process.alive():
                self._lose_matchers(self.process.why_gone())
                self.process.close()
                self._start_process()
            self.process.add(seq_id, params.spec())
        self.constrained.add(seq_id)

    def take_lost(self) -> dict[int, str]:
        """The seq_ids lost with a dead grammar process since the last call -> why (then forgotten here)."""
        lost, self.lost = self.lost, {}
        return lost

    def _lose_matchers(self, why) -> None:
        for seq_id in self.constrained:
            self.lost[seq_id] = str(why)
        self.constrained.clear()

    def remove(self, seq_id: int) -> None:
        if seq_id not in self.constrained:
            return
        self.constrained.discard(seq_id)
        if self.process is None:
            self.local.remove(seq_id)
        elif self.process.error is None:
            try:
                self.process.remove(seq_id)
            except grammar_process.GrammarProcessGone as e:
                self._lose_matchers(e)

    def accept_tokens(self, samples: list[tuple[Any, Any]]) -> set[int]:
        """Advance the matchers of the constrained sequences among `samples` ((Sequence, SampleResult)
        pairs of one step) by their tokens, in one batched call; returns the seq_ids whose grammar is now
        complete (it accepted a stop token, which is what xgrammar's `is_terminated` means).
        RuntimeError if a token violates its grammar (a sampler bug)."""
        seqs, tokens = [seq for seq, _ in samples], [r.token_id for _, r in samples]
        done = self._grammar_done(seqs, tokens)
        ids = [s.seq_id for s in seqs if not s.is_finished]
        tokens = [t for s, t in zip(seqs, tokens) if not s.is_finished]
        self._run(ids, tokens, None, done, 0, torch.device("cpu"))
        return done

    def fill_bitmask(self, seq_ids: list[int], device: torch.device) -> torch.Tensor | None:
        """The allowed tokens of the sequences `seq_ids` (row i for seq_ids[i]) as a packed bitmask
        [len(seq_ids), ceil(V/32)] int32 on `device`, all ones in the rows of unconstrained sequences;
        None when none is constrained. The copy to the device does not wait for it."""
        return self._run([], [], seq_ids, (), len(seq_ids), device)

    def _run(self, accept_ids, tokens, fill_ids, skip, rows: int, device: torch.device):
        """Accept, then fill, and wait (here, or a job of the grammar process); the mask on `device`."""
        start = time.perf_counter()
        fill = fill_ids is not None and not self.constrained.isdisjoint(fill_ids)
        if not fill and self.constrained.isdisjoint(accept_ids):
            return None  # no matcher to move: unconstrained steps never wait on (or fail with) the grammar process
        slot, host, event = self._slots.next(rows, device) if fill else (0, None, None)
        self.stats["steps"] += fill
        if self.process is None:
            times = self.local.run(accept_ids, tokens, fill_ids if fill else None, skip, host)
        else:
            try:
                times = self._wait(self.process, self.process.submit(accept_ids, tokens, fill_ids if fill else None,
                                                                     skip, slot))
            except grammar_process.GrammarProcessGone as e:
                self._lose_matchers(e)
                return None  # no mask: the lost sequences' tokens are dropped with their requests
        self._add_times(*times)
        out = self._slots.to_device(host, event, device)
        self.stats["main_s"] += time.perf_counter() - start
        return out

    def step_bitmask(self, seqs: list, previous, complete, device: torch.device):
        """(this step's bitmask, `complete`'s outputs). With the grammar process: the previous step's
        tokens are accepted and the rows of `seqs` (this step's sampling sequences) filled there while this
        thread runs `complete(previous, grammar_done)` (the engine's step completion); the bitmask is then a
        callable that reads the job's answer and returns the mask (the model runner calls it when the step's
        tokens are first needed, so this thread goes on meanwhile). Without it: `complete`, then the fill,
        in turn, and the mask itself. `previous`: the launched step still in flight (its `result()`), or
        None (its tokens were accepted already): then only the fill runs, and the outputs are None."""
        seq_ids = [s.seq_id for s in seqs]
        self._last_fill = (seqs, seq_ids)  # the next step accepts the tokens of these sequences
        if previous is None:
            return self.fill_bitmask(seq_ids, device), None
        if self.process is None:
            outputs = complete(previous)
            return self.fill_bitmask(seq_ids, device), outputs
        start = time.perf_counter()
        done_seqs, token_ids = previous.token_ids()  # not yet its SampleResults: `complete` builds them
        started = time.perf_counter()
        self.stats["tokens_wait_s"] += started - start
        job = self.start_step(done_seqs, token_ids, seq_ids, device)
        started = time.perf_counter()
        outputs = complete(previous, job.grammar_done)  # on an error the job is never read (nothing waits)
        self.stats["complete_s"] += time.perf_counter() - started
        return (lambda: self.finish_step(job, device)), outputs

    def start_step(self, seqs: list, token_ids: list[int], seq_ids: list[int], device: torch.device) -> GrammarJob:
        """Send the grammar process a step's job: advance the matchers of the unfinished constrained `seqs`
        by `token_ids` (the previous step's samples), then `fill_bitmask(seq_ids)`; returns at once (read
        with `finish_step`). The job's `grammar_done` is what `accept_tokens` would return; the rows of
        those sequences are all ones (their tokens of this step are dropped, like before)."""
        start = time.perf_counter()
        done = self._grammar_done(seqs, token_ids)
        fill = not self.constrained.isdisjoint(seq_ids)
        slot, host, event = self._slots.next(len(seq_ids), device) if fill else (0, None, None)
        self.stats["steps"] += fill
        last_seqs, last_ids = self._last_fill
        accept_ids = last_ids if seqs is last_seqs else [s.seq_id for s in seqs]  # the previous step's rows
        process = self.process
        try:
            job_id = process.submit(accept_ids, token_ids, seq_ids if fill else None, done, slot)
        except grammar_process.GrammarProcessGone as e:
            self._lose_matchers(e)
            job_id, process = -1, None
        self.stats["main_s"] += time.perf_counter() - start
        return GrammarJob(job_id, slot, host, event, done, process)

    def finish_step(self, job: GrammarJob, device: torch.device) -> torch.Tensor | None:
        """Wait for `start_step`'s job (its RuntimeError re-raised); its bitmask on `device`, or None (also when
        the grammar process is gone: its sequences are then `lost`, and the step's rows sample unmasked)."""
        start = time.perf_counter()
        if job.process is None:
            return None
        try:
            self._add_times(*self._wait(job.process, job.job_id))
        except grammar_process.GrammarProcessGone as e:
            if job.process is self.process:  # else a fresh process took over and the old one's sequences are lost
                self._lose_matchers(e)
            return None
        out = self._slots.to_device(job.host, job.event, device)
        self.stats["main_s"] += time.perf_counter() - start
        return out

    def _wait(self, process, job_id: int) -> tuple[float, float, float]:
        start = time.perf_counter()
        try:
            return process.result(job_id)
        finally:
            self.stats["wait_s"] += time.perf_counter() - start

    def _add_times(self, accept_s: float, fill_s: float, job_s: float = 0.0) -> None:
        self.stats["accept_s"] += accept_s
        self.stats["fill_s"] += fill_s
        self.stats["job_s"] += job_s

    def _grammar_done(self, seqs: list, token_ids: list[int]) -> set[int]:
        """The seq_ids of the unfinished constrained `seqs` whose token is a stop token."""
        stops, constrained = self._stop_ids, self.constrained
        if stops.isdisjoint(token_ids):  # most steps: no loop in Python
            return set()
        return {seqs[i].seq_id for i, t in enumerate(token_ids)
                if t in stops and seqs[i].seq_id in constrained and not seqs[i].is_finished}
