"""Structured outputs: vLLM's `StructuredOutputsParams`, compiled and enforced with xgrammar.

A request names one constraint (a JSON schema, any JSON object, a regex, a list of choices or an EBNF
grammar). `StructuredOutputManager.compile` turns it into an xgrammar `CompiledGrammar` (cached by
xgrammar's compiler, so checking a request in the server and admitting it in the engine compile once);
each sequence then gets its own `GrammarMatcher`. Per step the host work is two batched xgrammar calls per
worker thread, no Python loop over matchers: `batch_accept_token` advances every constrained matcher by
the previous step's token, then `batch_fill_next_token_bitmask` writes one row of allowed tokens per
sampling sequence (a packed int32 bitmask, 32 tokens per word, xgrammar's layout; all ones for
unconstrained rows and for grammars that just completed) into a reused pinned host buffer, copied to a
reused device buffer without waiting; the sampler masks the logits in place there with one kernel
(`Sampler`, `apply_token_bitmask`). With async scheduling the engine starts both calls on worker threads
(the sequences split by seq_id) once the step's forward pass is launched and the previous step's token ids
are read (`step_bitmask`), completes the previous step on its main thread meanwhile, and joins when the
step samples, at the next launch (grammar_bitmask.py says why threads). Sequences without a grammar cost
one dict lookup per step.

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

from fxrewrite.runtime.engine.grammar_bitmask import BitmaskFiller, GrammarJob

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


def default_grammar_threads() -> int:
    """Worker threads of a step's grammar work: FXREWRITE_GRAMMAR_THREADS, else 2 with 8 or more cores
    (half the batch each: accept and fill scale with the matchers, each thread adds GIL hand-offs to the
    main thread), else 1."""
    value = os.environ.get("FXREWRITE_GRAMMAR_THREADS")
    if value:
        if not value.isdigit() or int(value) < 1:
            raise ValueError(f"FXREWRITE_GRAMMAR_THREADS={value!r}: expected a positive integer")
        return int(value)
    return 2 if (os.cpu_count() or 1) >= 8 else 1


def _clean(message: str) -> str:
    """xgrammar's message without its C++ log prefix ("[12:00:00] /project/cpp/x.cc:12: ")."""
    message = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", message.strip())
    return message.removeprefix("Check failed: (error.empty()) is false: ")


_COMPILERS: dict[tuple, Any] = {}


def grammar_compiler(xgr, tokenizer: Any, vocab_size: int, stop_token_ids: set[int]):
    """xgrammar's `GrammarCompiler` (thread-safe, its compiled grammars cached) for `tokenizer`, shared by
    this process's engines of one tokenizer folder: its `TokenizerInfo` reads the whole vocabulary (seconds
    for Qwen's 151,936 tokens). Keyed by the folder, its tokenizer.json's size and mtime, the tokenizer's
    length, vocab_size and the stop ids; a tokenizer without a folder gets its own."""
    folder = getattr(tokenizer, "name_or_path", "") or ""
    path = os.path.join(folder, "tokenizer.json")
    stat = os.stat(path) if folder and os.path.isfile(path) else None
    key = (os.path.abspath(folder), stat and (stat.st_size, stat.st_mtime_ns), len(tokenizer), vocab_size,
           tuple(sorted(stop_token_ids)))
    compiler = _COMPILERS.get(key) if stat else None
    if compiler is None:
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=sorted(stop_token_ids))
        compiler = xgr.GrammarCompiler(info, max_threads=4, cache_enabled=True)
        if stat:
            while len(_COMPILERS) >= 4:  # a few tokenizers per process at most
                _COMPILERS.pop(next(iter(_COMPILERS)))
            _COMPILERS[key] = compiler
    return compiler


class StructuredOutputManager:
    """Compiles constraints for one tokenizer and keeps one matcher per constrained sequence.

    Args:
        tokenizer: the Hugging Face tokenizer of the model.
        vocab_size: the number of logits (rows of the LM head; may exceed len(tokenizer)).
        eos_token_ids: tokens that end a completion (the grammar's stop tokens).
        max_threads: worker threads of a step's grammar work (default: `default_grammar_threads()`).
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: set[int], max_threads: int | None = None):
        import xgrammar as xgr  # optional dependency (the serve extra): only constrained requests need it

        self._xgr = xgr
        self.vocab_size = vocab_size
        self.compiler = grammar_compiler(xgr, tokenizer, vocab_size, eos_token_ids)
        self._stop_ids = frozenset(eos_token_ids)
        threads = max_threads or default_grammar_threads()
        self._filler = BitmaskFiller(xgr, xgr.get_bitmask_shape(1, vocab_size)[1], threads)
        self.matchers: dict[int, Any] = {}
        """seq_id -> xgrammar GrammarMatcher."""
        self.overlap = True
        """Whether the engine runs a step's grammar work on the worker thread (`start_step`); False: on the
        main thread after completing the previous step (the sequential path, for comparisons)."""

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
        accept, done = self._accept_plan([seq for seq, _ in samples], [r.token_id for _, r in samples], 1)
        self._filler.run(accept[0], ([], []), 0, torch.device("cpu"))
        return done

    def fill_bitmask(self, seq_ids: list[int], device: torch.device) -> torch.Tensor | None:
        """The allowed tokens of the sequences `seq_ids` (row i for seq_ids[i]) as a packed bitmask
        [len(seq_ids), ceil(V/32)] int32 on `device`, all ones in the rows of unconstrained sequences;
        None when none is constrained. The copy to the device does not wait for it."""
        return self._filler.run(([], [], []), self._fill_plan(seq_ids, (), 1)[0], len(seq_ids), device)

    def step_bitmask(self, seqs: list, previous, complete, device: torch.device):
        """(this step's bitmask, `complete`'s outputs): the previous step's tokens are accepted and the rows of
        `seqs` (this step's sampling sequences) filled on the worker threads while this thread runs
        `complete(previous, grammar_done)` (the engine's step completion); the bitmask is then a callable
        that joins the job and returns the mask (the model runner calls it when the step's tokens are first
        needed, so this thread goes on meanwhile). `overlap` False: `complete`, then the fill, in turn, and
        the mask itself. `previous`: the launched step still in flight (its `result()`), or None (its tokens
        were accepted already): then only the fill runs, here, and the outputs are None."""
        seq_ids = [s.seq_id for s in seqs]
        if previous is None:
            return self.fill_bitmask(seq_ids, device), None
        if not self.overlap:
            outputs = complete(previous)
            return self.fill_bitmask(seq_ids, device), outputs
        stats, start = self._filler.stats, time.perf_counter()
        done_seqs, token_ids = previous.token_ids()  # not yet its SampleResults: `complete` builds them
        started = time.perf_counter()
        stats["tokens_wait_s"] += started - start
        job = self.start_step(done_seqs, token_ids, seq_ids, device)
        started = time.perf_counter()
        outputs = complete(previous, job.grammar_done)  # on an error the job ends unjoined (nothing waits on it)
        stats["complete_s"] += time.perf_counter() - started
        return (lambda: self.finish_step(job, device)), outputs

    def start_step(self, seqs: list, token_ids: list[int], seq_ids: list[int], device: torch.device) -> GrammarJob:
        """Advance the matchers of the unfinished constrained `seqs` by `token_ids` (the previous step's
        samples), then `fill_bitmask(seq_ids)`, started on the worker threads; returns at once (join with
        `finish_step`). The job's `grammar_done` is what `accept_tokens` would return; the rows of those
        sequences are all ones (their tokens of this step are dropped, like before)."""
        k = self._filler.num_threads
        accepts, done = self._accept_plan(seqs, token_ids, k)
        return self._filler.start(accepts, self._fill_plan(seq_ids, done, k), len(seq_ids), device, done)

    def finish_step(self, job: GrammarJob, device: torch.device) -> torch.Tensor | None:
        """Wait for `start_step`'s job (its RuntimeError re-raised); its bitmask on `device`, or None."""
        return self._filler.finish(job, device)

    def _accept_plan(self, seqs: list, token_ids: list[int], k: int) -> tuple[list[tuple[list, list, list]], set[int]]:
        """(k chunks of (matchers, token ids, seq_ids) of the unfinished constrained `seqs`, the seq_ids whose
        token is a stop token). Chunk = seq_id % k, as in `_fill_plan`: one thread accepts a matcher's token
        and then fills its row (a matcher is never used by two threads at once)."""
        get, stops = self.matchers.get, self._stop_ids
        chunks: list[tuple[list, list, list]] = [([], [], []) for _ in range(k)]
        done = set()
        for seq, token_id in zip(seqs, token_ids):
            seq_id = seq.seq_id
            matcher = get(seq_id)
            if matcher is not None and not seq.is_finished:
                matchers, tokens, seq_ids = chunks[seq_id % k]
                matchers.append(matcher)
                tokens.append(token_id)
                seq_ids.append(seq_id)
                if token_id in stops:
                    done.add(seq_id)
        return chunks, done

    def _fill_plan(self, seq_ids: list[int], skip, k: int) -> list[tuple[list, list]]:
        """k chunks (seq_id % k) of (matchers, rows) of the constrained `seq_ids` not in `skip` (finished
        grammars)."""
        get = self.matchers.get
        chunks: list[tuple[list, list]] = [([], []) for _ in range(k)]
        for i, seq_id in enumerate(seq_ids):
            matcher = get(seq_id)
            if matcher is not None and seq_id not in skip:
                matchers, rows = chunks[seq_id % k]
                matchers.append(matcher)
                rows.append(i)
        return chunks

    @property
    def stats(self) -> dict:
        """Host seconds spent accepting / filling and the number of fills (`BitmaskFiller.stats`)."""
        return self._filler.stats
