"""Where a step's grammar work runs: the matchers of the constrained sequences (`MatcherSet`), and the
grammar process's main loop (`main`), which owns them when the engine runs the work in its own process.

This file imports nothing from fxrewrite (only the standard library, torch and xgrammar): the grammar
process loads it by path, so starting it costs one `import xgrammar` and no engine import.

Protocol (grammar_process.py is the other end): length-prefixed pickles on two pipes. Parent -> child:
("add", seq_id, spec) compiles `spec` (kind, value, disable_any_whitespace; xgrammar's compiler caches
it) and makes the sequence's matcher, ("remove", seq_id) drops it, neither answered; ("job", job_id,
accept_ids, tokens, fill_ids, skip, slot) advances the matchers of `accept_ids` by `tokens`, then (fill_ids
not None) fills row i of mask slot `slot` for fill_ids[i] (all ones for sequences without a matcher or in
`skip`), and answers (job_id, error or None, accept seconds, fill seconds, job seconds). The child starts
with ("ready",) and exits at end of input (the parent closed its pipe or died).
"""

from __future__ import annotations

import json
import os
import pickle
import struct
import sys
import time
from typing import Any

HEADER = struct.Struct("<Q")
"""The length prefix of a message (bytes of its pickle)."""


def compile_constraint(compiler: Any, kind: str, value: Any, disable_any_whitespace: bool):
    """xgrammar's CompiledGrammar of one constraint (kind: json, json_object, regex, choice, grammar;
    value: a JSON schema as a dict or text, a regex, a list of choices or an EBNF text). Raises xgrammar's
    error for an invalid one."""
    any_whitespace = not disable_any_whitespace
    if kind == "json":
        schema = value if isinstance(value, str) else json.dumps(value)
        return compiler.compile_json_schema(schema, any_whitespace=any_whitespace)
    if kind == "json_object":  # any object (as a schema, so disable_any_whitespace applies)
        return compiler.compile_json_schema('{"type": "object"}', any_whitespace=any_whitespace)
    if kind == "regex":
        return compiler.compile_regex(value)
    if kind == "choice":
        return compiler.compile_grammar(choice_grammar(value))
    return compiler.compile_grammar(value)


def choice_grammar(choices: list[str]) -> str:
    """EBNF accepting exactly one of `choices` (JSON string escapes are valid EBNF literal escapes). Non-ASCII text
    raw: xgrammar reads a JSON surrogate pair escape ("\\ud83d\\ude00") as two lone surrogates, so a choice
    holding a character past U+FFFF (an emoji) could never be generated."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class MatcherSet:
    """seq_id -> xgrammar GrammarMatcher, and a step's work on them: one batched accept, one batched fill
    (xgrammar's BatchGrammarMatcher with one thread: the calling thread fills)."""

    def __init__(self, xgr: Any):
        self._xgr = xgr
        self._core = getattr(getattr(xgr, "base", None), "_core", None)
        self._batch = xgr.BatchGrammarMatcher(1)
        self.matchers: dict[int, Any] = {}

    def add(self, seq_id: int, compiled) -> None:
        self.matchers[seq_id] = self._xgr.GrammarMatcher(compiled)

    def remove(self, seq_id: int) -> None:
        self.matchers.pop(seq_id, None)

    def run(self, accept_ids: list[int], tokens: list[int], fill_ids: list[int] | None, skip, host) -> tuple[float, float]:
        """Advance the matchers of `accept_ids` (those that have one) by `tokens`, then fill row i of `host`
        ([len(fill_ids), W] int32) for fill_ids[i]: the matcher's allowed tokens, all ones without a matcher
        or in `skip`. RuntimeError when a token violates its grammar. Returns (seconds accepting, filling)."""
        start = time.perf_counter()
        get = self.matchers.get
        pairs = [(m, t, s) for s, t in zip(accept_ids, tokens) if (m := get(s)) is not None]
        if pairs:
            i = self._accept([m for m, _, _ in pairs], [t for _, t, _ in pairs])
            if i >= 0:
                raise RuntimeError(f"sequence {pairs[i][2]}: token {pairs[i][1]} violates its grammar (a sampler bug)")
        filled = time.perf_counter()
        if fill_ids is not None and host is not None:
            rows, matchers, missing = [], [], []
            for i, s in enumerate(fill_ids):
                m = get(s)
                if m is None or s in skip:
                    missing.append(i)
                else:
                    rows.append(i)
                    matchers.append(m)
            if missing:
                host[missing] = -1  # unconstrained or completed rows: every token allowed
            if matchers:
                self._fill(matchers, host, rows)
        return filled - start, time.perf_counter() - filled

    def _fill(self, matchers: list, host, rows: list[int]) -> None:
        if self._core is None:
            self._batch.batch_fill_next_token_bitmask(matchers, host, rows)
        else:
            self._batch._handle.batch_fill_next_token_bitmask([m._handle for m in matchers], host, rows, False)

    def _accept(self, matchers: list, tokens: list[int]) -> int:
        """The index of the first token refused, or -1. xgrammar's public `batch_accept_token` turns the
        binding's result into Python bools one FFI call per element, so the binding is called directly
        when this xgrammar has it."""
        if self._core is None:
            accepted = self._xgr.BatchGrammarMatcher.batch_accept_token(matchers, tokens)
            return -1 if all(accepted) else accepted.index(False)
        result = self._core.BatchGrammarMatcher.batch_accept_token([m._handle for m in matchers], tokens, False)
        return -1 if 0 not in result else [bool(ok) for ok in result].index(False)


def write_message(fd: int, obj: Any) -> None:
    """One length-prefixed pickle on `fd` (all of it, however the pipe splits the write)."""
    payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    data = memoryview(HEADER.pack(len(payload)) + payload)
    while data:
        data = data[os.write(fd, data):]


def read_message(fd: int) -> Any:
    """The next message on `fd`; EOFError at end of input."""
    size = HEADER.unpack(_read_exact(fd, HEADER.size))[0]
    return pickle.loads(_read_exact(fd, size))


def _read_exact(fd: int, n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = os.read(fd, left)
        if not chunk:
            raise EOFError("the other end of the grammar pipe closed")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def main(argv: list[str]) -> None:
    """The grammar process: argv = read fd, write fd, mask memfd, tokenizer-info memfd, rows, width. Ends when the
    engine closes its pipe: at a read (end of file) or at a write (a broken pipe, quietly: the engine has gone)."""
    try:
        _serve(argv)
    except BrokenPipeError:
        return


def _serve(argv: list[str]) -> None:
    import mmap
    import signal

    import torch
    import xgrammar as xgr

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # its own session: the engine ends it by closing the pipe

    rfd, wfd, mask_fd, info_fd, rows, width = (int(a) for a in argv)
    with os.fdopen(info_fd, "rb") as f:
        info = xgr.TokenizerInfo.deserialize_json(f.read().decode())
    compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=True)
    slots = torch.frombuffer(mmap.mmap(mask_fd, 2 * rows * width * 4), dtype=torch.int32).view(2, rows, width)
    matchers, failed = MatcherSet(xgr), {}
    write_message(wfd, ("ready",))
    while True:
        try:
            message = read_message(rfd)
        except EOFError:
            return
        if message[0] == "add":
            _, seq_id, spec = message
            try:
                matchers.add(seq_id, compile_constraint(compiler, *spec))
            except Exception as e:  # noqa: BLE001 - reported at the sequence's next job
                failed[seq_id] = f"sequence {seq_id}: its grammar did not compile in the grammar process: {e}"
            continue
        if message[0] == "remove":
            matchers.remove(message[1])
            failed.pop(message[1], None)
            continue
        write_message(wfd, _job(matchers, failed, slots, *message[1:]))


def _job(matchers: MatcherSet, failed: dict, slots, job_id, accept_ids, tokens, fill_ids, skip, slot):
    start = time.perf_counter()
    try:
        bad = [failed[s] for s in (*accept_ids, *(fill_ids or ())) if s in failed] if failed else None
        if bad:
            raise RuntimeError(bad[0])
        host = slots[slot, : len(fill_ids)] if fill_ids is not None else None
        accept_s, fill_s = matchers.run(accept_ids, tokens, fill_ids, skip, host)
    except Exception as e:  # noqa: BLE001 - raised on the parent's main thread
        return job_id, str(e) or type(e).__name__, 0.0, 0.0, 0.0
    return job_id, None, accept_s, fill_s, time.perf_counter() - start


if __name__ == "__main__":
    main(sys.argv[1:])
