"""`fxrewrite bench compare`: one workload through several arms, each in its own process by default.

Arms: before (transformers modeling code, no rewrite), after (transformers code rewritten by
fxrewrite), native (runtime/models), hf (stock transformers `generate_batch`, throughput only).
Writes `benchmarks/results/<date>-<config>-<workload>.json` after every arm (so a run stopped
from outside keeps the arms already done) and a PNG bar chart next to it at the end.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import time
import traceback
from pathlib import Path

from fxrewrite.benchmarks.common import (RESULTS_DIR, bench_model_dir, device_label, environment,
                                         experts_implementation, free_device_memory, load_bench_config, make_llm)
from fxrewrite.benchmarks.hf_arm import run_hf_throughput
from fxrewrite.benchmarks.latency import LatencyWorkload, run_latency
from fxrewrite.benchmarks.long import LongWorkload, run_long
from fxrewrite.benchmarks.plot import HEADLINES, headline, plot_result
from fxrewrite.benchmarks.throughput import ThroughputWorkload, run_throughput
from fxrewrite.errors import UserInputError, is_integer

WORKLOADS = ("throughput", "latency", "long")


def make_workload(kind: str, num_prompts: int | None = None, defaults: dict | None = None,
                  overrides: dict | None = None):
    """The workload dataclass of `kind`: its own defaults, then the bench config's `workload_defaults`
    for that kind (`defaults`: the tiny config keeps CPU runs short), then `overrides`, then `num_prompts`."""
    classes = {"throughput": ThroughputWorkload, "latency": LatencyWorkload, "long": LongWorkload}
    if kind not in classes:
        raise UserInputError(f"unknown workload {kind!r}; expected one of {', '.join(WORKLOADS)}")
    fields = {**(defaults or {}), **(overrides or {})}
    if num_prompts and kind != "throughput":  # was ignored: a latency run of --num-prompts 4 ran its batch sizes
        raise UserInputError(f"--num-prompts applies to the throughput workload, not --workload {kind} (its request "
                             "counts are the workload's own: latency's batch sizes, long's one prompt per length)")
    if num_prompts:
        fields["num_prompts"] = num_prompts
    workload = classes[kind](**_checked_fields(kind, classes[kind], fields))
    if kind == "throughput" and workload.min_len > min(workload.max_input_len, workload.max_output_len):
        raise UserInputError(f"throughput workload: min_len={workload.min_len} must be at most max_input_len="
                             f"{workload.max_input_len} and max_output_len={workload.max_output_len}")
    return workload


_AT_LEAST_ZERO = ("decode_window_steps", "prefix_len", "max_token_id")


def _checked_fields(kind: str, cls, fields: dict) -> dict:
    """`fields` when each names a field of `cls` and holds a value of its kind: counts and lengths positive
    integers (or lists of them), `_AT_LEAST_ZERO` ones >= 0; UserInputError naming the first that does not (a
    bench config's `num_prompts: -4` ran no request and reported 0.0 tokens/s)."""
    known = {f.name: f for f in dataclasses.fields(cls)}
    for key, value in fields.items():
        if key not in known:
            raise UserInputError(f"{kind} workload: unknown field {key!r}; expected some of {', '.join(known)}")
        if key == "seed":
            ok, expected = is_integer(value), "an integer"
        elif key in ("temperature", "yarn_factor"):
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value >= (key == "yarn_factor")
            expected = "a number >= 0" if key == "temperature" else "a number >= 1"
        elif isinstance(value, list) or key in ("batch_sizes", "prompt_lens"):
            ok = isinstance(value, list) and bool(value) and all(is_integer(v) and v >= 1 for v in value)
            expected = "a non-empty list of positive integers"
        else:
            low = 0 if key in _AT_LEAST_ZERO else 1
            ok, expected = is_integer(value) and value >= low, f"an integer >= {low}"
        if not ok:
            raise UserInputError(f"{kind} workload: {key}={value!r} must be {expected}")
    return fields


def _arm_process(arm, model_dir, spec, workload, engine_kwargs, time_limit_s, hf_num_prompts, num_threads, out):
    """Child process body: run one arm, write its figures (or its error) as JSON to `out`."""
    import torch

    torch.set_num_threads(num_threads)
    try:
        figures = run_arm(arm, model_dir, spec, workload, engine_kwargs, time_limit_s, hf_num_prompts)
    except Exception as e:  # noqa: BLE001 - reported in the result, like an in-process arm
        figures = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-2000:]}
    Path(out).write_text(json.dumps(figures))


def run_arm_isolated(arm, model_dir, spec, workload, engine_kwargs, time_limit_s, hf_num_prompts) -> dict:
    """`run_arm` in a fresh process (spawned): whatever the arm allocates, on the GPU or in this
    process's caches, goes when it exits, whether it succeeded, raised or crashed."""
    import multiprocessing
    import tempfile

    import torch

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "figures.json"
        proc = multiprocessing.get_context("spawn").Process(
            target=_arm_process, args=(arm, model_dir, spec, workload, engine_kwargs, time_limit_s,
                                       hf_num_prompts, torch.get_num_threads(), str(out)))
        proc.start()
        proc.join()
        if out.exists():
            return json.loads(out.read_text())
        return {"error": f"the arm's process exited with code {proc.exitcode} before writing its figures"}


def run_arm(arm, model_dir, spec, workload, engine_kwargs, time_limit_s, hf_num_prompts) -> dict:
    """One arm's figures: the hf arm or an engine arm."""
    if arm == "hf":
        unmatched = hf_arm_unmatched(engine_kwargs, spec)
        if unmatched:  # transformers would run another model than the engine arms: no figure beats a wrong one
            return {"skipped": f"the hf arm runs transformers' generate_batch on the unquantized model, without "
                               f"{' and '.join(unmatched)}; compare it in a run without that"}
        return run_hf(model_dir, workload, hf_num_prompts, engine_kwargs.get("device"),
                      engine_kwargs.get("dtype", "auto"))
    return run_engine_arm(arm, model_dir, spec, workload, dict(engine_kwargs), time_limit_s)


def hf_arm_unmatched(engine_kwargs: dict, spec: dict | None = None) -> list[str]:
    """The settings of this run that the hf arm cannot apply (it would measure another model): quantization, an
    FP8 KV cache, a quantization_config in the config (an --hf-overrides object: dummy weights quantized at load)."""
    out = [f"quantization={engine_kwargs['quantization']!r}"] if engine_kwargs.get("quantization") else []
    if (spec or {}).get("config", {}).get("quantization_config"):
        out.append("the config's quantization_config")
    if engine_kwargs.get("kv_cache_dtype", "auto") != "auto":
        out.append(f"kv_cache_dtype={engine_kwargs['kv_cache_dtype']!r}")
    return out


def run_engine_arm(arm: str, model_dir: Path, spec: dict, workload, engine_kwargs: dict,
                   time_limit_s: float | None) -> dict:
    """Build the arm's engine, run the workload, return its figures (plus setup seconds)."""
    kind = workload.describe()["kind"]
    kwargs = {"max_model_len": workload.max_model_len, **engine_kwargs}
    if kind == "long":
        theta = spec["config"].get("rope_theta", 1e6)
        kwargs.update(hf_overrides=workload.hf_overrides(theta), enable_prefix_caching=False, max_num_seqs=4)
    start = time.perf_counter()
    llm = make_llm(arm, model_dir, **kwargs)
    setup_s = time.perf_counter() - start
    runner = llm.llm_engine.model_runner
    graphs = getattr(runner, "graph_runner", None)
    buckets = len(graphs.graphs) if graphs else getattr(runner.model, "cuda_graph_buckets", 0)  # TP: the workers'
    setup = {"setup_s": round(setup_s, 1), "dtype": str(llm.llm_engine.model_config.dtype).removeprefix("torch."),
             "cuda_graph_buckets": buckets,
             "compiled": bool(getattr(runner.model, "_fxrewrite_compiled", False))}
    if setup["compiled"]:  # which forward each kind of step runs (the faster, timed at load; cuda_graphs.py)
        setup["step_forward"] = getattr(runner, "step_forward", None)
        seconds = getattr(runner, "step_forward_seconds", {})
        setup["step_forward_ms"] = {kind: round(s * 1e3, 2) for kind, s in seconds.items()}
        if graphs:
            setup["decode_graph_forwards"] = {bs: graphs.forward_kind.get(bs) for bs in graphs.sizes}
    experts = experts_implementation(llm)
    if experts is not None:  # MoE configs: what ran the experts (the before arm: transformers' eager loop)
        setup["experts_implementation"] = experts
    run = {"throughput": run_throughput, "latency": run_latency, "long": run_long}[kind]
    try:
        figures = run(llm, workload, time_limit_s)
    finally:
        stats = llm.llm_engine.get_stats()
        del llm, runner, graphs
        free_device_memory()
    return {**setup, "num_kv_blocks": stats["num_blocks"], **figures}


def run_hf(model_dir: Path, workload, hf_num_prompts: int | None, device: str | None = None,
           dtype: str = "auto") -> dict:
    """transformers' `generate_batch` on `device` (default: cuda when available, else cpu), in the engine arms'
    `dtype` (resolved from the config as the engine resolves it)."""
    import torch

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")

    if workload.describe()["kind"] != "throughput":
        return {"skipped": "the hf arm runs the throughput workload only"}
    prompts, output_lens = workload.generate()
    n = min(hf_num_prompts or len(prompts), len(prompts))
    try:
        return run_hf_throughput(model_dir, prompts[:n], output_lens[:n], device=device, dtype=dtype)
    finally:
        free_device_memory()


def compare(config: str | Path, arms: list[str], workload_kind: str = "throughput", *,
            num_prompts: int | None = None, hf_num_prompts: int | None = 64, engine_kwargs: dict | None = None,
            time_limit_s: float | None = None, out_dir: Path = RESULTS_DIR, notes: list[str] | None = None,
            workload_overrides: dict | None = None, tokenizer_dir: str | Path | None = None,
            isolate: bool = True, config_overrides: dict | None = None) -> dict:
    """Run `arms` on one workload; returns the result dict also written to `out_dir` (JSON + PNG).

    An arm that raises is recorded with its error and the next arm still runs. With `isolate` (the
    default) each arm runs in its own process, so nothing one arm allocated is left for the next; arms with
    tensor, pipeline or data parallelism run here (they start and stop worker processes of their own, and from
    a spawned arm process they did not come up on the H200 pair, 2026-11-30)."""
    spec = load_bench_config(config)
    if config_overrides:  # a variant of the config (e.g. fewer layers), with a folder and result name of its own
        spec = {**spec, "config": {**spec["config"], **config_overrides},
                "name": spec["name"] + "".join(_override_tag(k, v) for k, v in sorted(config_overrides.items()))}
    defaults = spec.get("workload_defaults", {}).get(workload_kind, {})
    workload = make_workload(workload_kind, num_prompts, defaults, workload_overrides)
    _check_window_fits(workload, arms, engine_kwargs or {})
    model_dir = bench_model_dir(spec, tokenizer_dir)
    env = environment()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = _result_stem(spec["name"], workload_kind, engine_kwargs or {})
    window = getattr(workload, "decode_window_steps", 0)
    stem += f"-decode-window{window}" if window else ""  # another headline: beside the full run, not over it
    result = {
        "name": stem, "date": env["date"], "config": spec["name"], "environment": env,
        "workload": workload.describe(), "engine_kwargs": {"load_format": "dummy", **(engine_kwargs or {})},
        "config_overrides": dict(config_overrides or {}), "time_limit_s_per_arm": time_limit_s, "notes": list(notes or []), "arms": {},
    }
    if "hf" in arms and workload_kind == "throughput":
        result["hf_num_prompts"] = hf_num_prompts
    stem = _unused_stem(out_dir, stem)
    result["name"] = stem
    json_path = out_dir / f"{stem}.json"
    arm_args = (model_dir, spec, workload, dict(engine_kwargs or {}), time_limit_s, hf_num_prompts)
    kw = engine_kwargs or {}  # multi-process engines already run in their own processes
    isolate = isolate and all((kw.get(k) or 1) == 1 for k in ("tensor_parallel_size", "pipeline_parallel_size",
                                                              "data_parallel_size"))
    for i, arm in enumerate(arms, 1):
        print(f"[bench] {spec['name']} {workload_kind}: arm {arm} ({i}/{len(arms)}) ...", flush=True)
        if isolate:
            figures = run_arm_isolated(arm, *arm_args)
        else:
            try:
                figures = run_arm(arm, *arm_args)
            except Exception as e:  # record and go on: one broken arm must not lose the others
                figures = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-2000:]}
                free_device_memory()
        result["arms"][arm] = figures
        if arm == "hf" and "num_requests" in figures:  # the prompts it ran: at most the workload's
            result["hf_num_prompts"] = figures["num_requests"]
        print(f"[bench] {arm}: {json.dumps({k: v for k, v in figures.items() if k != 'traceback'})}", flush=True)
        json_path.write_text(json.dumps(result, indent=2) + "\n")
    result["ratios"] = ratios(result)
    json_path.write_text(json.dumps(result, indent=2) + "\n")
    png = plot_result(result, out_dir / f"{stem}.png")
    result["files"] = [str(json_path)] + ([str(png)] if png else [])
    return result


def _check_window_fits(workload, arms: list[str], engine_kwargs: dict) -> None:
    """UserInputError when a decode window is asked for and an engine arm can never run every request at once
    (max_num_seqs x data_parallel_size below the request count): each such arm ran its whole workload and
    reported no figure, with nothing in the table saying why."""
    window = getattr(workload, "decode_window_steps", 0)
    if not window or not set(arms) - {"hf"}:
        return
    dp = engine_kwargs.get("data_parallel_size") or 1
    running = (engine_kwargs.get("max_num_seqs") or 256) * dp
    if running < workload.num_prompts:
        raise UserInputError(
            f"--decode-window {window} measures steps with all {workload.num_prompts} requests running, but "
            f"--max-num-seqs {engine_kwargs.get('max_num_seqs') or 256}{f' x {dp} replicas' if dp > 1 else ''} runs at "
            f"most {running} at once; expected --max-num-seqs of at least {-(-workload.num_prompts // dp)} or "
            f"--num-prompts of at most {running}")


def _override_tag(key: str, value) -> str:
    """A config override's part of the result name: ``-32layers``, ``-rope_theta1000000.0``, or for an object
    (``quantization_config``) its key and a digest of its JSON, so two variants never share a file name."""
    if key == "num_hidden_layers":
        return f"-{value}layers"
    if isinstance(value, (dict, list)):
        return f"-{key}-{hashlib.sha1(json.dumps(value, sort_keys=True).encode()).hexdigest()[:8]}"
    return f"-{key}{value}"


def _unused_stem(out_dir: Path, stem: str) -> str:
    """`stem`, or ``stem-2``, ``stem-3``, ... when `out_dir` already holds a result of that name (another run the
    same day with other arms, prompts or limits must not overwrite it); says which name it took."""
    chosen, n = stem, 1
    while (out_dir / f"{chosen}.json").exists():
        n += 1
        chosen = f"{stem}-{n}"
    if chosen != stem:
        print(f"[bench] {out_dir / (stem + '.json')} exists: this run writes {chosen}.json", flush=True)
    return chosen


def _result_stem(name: str, workload_kind: str, kw: dict) -> str:
    """<date>-<config>-<workload>, then the parallel sizes, expert parallel, quantization, KV-cache dtype and
    -O level the run used (a -O 3 or TP=2 run beside its baseline in one folder must not overwrite it)."""
    stem = f"{datetime.date.today().isoformat()}-{name}-{workload_kind}"
    for key, tag in (("tensor_parallel_size", "tp"), ("pipeline_parallel_size", "pp"), ("data_parallel_size", "dp")):
        stem += f"-{tag}{kw[key]}" if (kw.get(key) or 1) > 1 else ""
    stem += "-ep" if kw.get("enable_expert_parallel") else ""
    stem += f"-{kw['quantization']}" if kw.get("quantization") else ""
    stem += f"-kv{kw['kv_cache_dtype']}" if kw.get("kv_cache_dtype", "auto") != "auto" else ""
    return stem + (f"-O{kw['compilation_config']}" if kw.get("compilation_config") else "")

def ratios(result: dict) -> dict:
    """after/native, after/before and native/hf of the headline figure, where both arms have one of the same kind
    (throughput: from the arms' output tokens and seconds, not the figure rounded to 0.1 tokens/s; with
    --decode-window the hf arm's whole-run figure is not compared with the engine arms' window)."""
    kind = result["workload"]["kind"]
    values = {arm: _unrounded_headline(r, kind) for arm, r in result["arms"].items()}
    keys = {arm: r.get("headline_key") for arm, r in result["arms"].items()}
    out = {}
    for a, b in (("after", "native"), ("after", "before"), ("native", "hf"), ("after", "hf")):
        if values.get(a) is not None and values.get(b) and keys.get(a) == keys.get(b):
            out[f"{a}/{b}"] = round(values[a] / values[b], 3)
    return out


def _unrounded_headline(arm_result: dict, kind: str) -> float | None:
    value = headline(arm_result, kind)
    plain = kind == "throughput" and "headline_key" not in arm_result  # the headline is output tokens / elapsed s
    if value is not None and plain and arm_result.get("elapsed_s"):
        return arm_result["output_tokens"] / arm_result["elapsed_s"]
    return value


def format_tables(folder: str | Path, since: float = 0.0) -> str:
    """The tables (:func:`format_table`) of the comparison JSONs in `folder` written at or after `since` (seconds
    since the epoch), what gpu_check.sh prints last: its folder is benchmarks/results without $OUT, where the
    train, RL and kernel JSONs (whose "arms" are no comparison's) and every earlier run's results also lie."""
    tables = []
    for path in sorted(Path(folder).glob("*.json")):
        if path.stat().st_mtime < since:
            continue
        result = json.loads(path.read_text())
        if isinstance(result, dict) and isinstance(result.get("arms"), dict) and "kind" in result.get("workload", {}):
            tables.append(format_table(result))
    return "\n\n".join(tables)


def _no_figure_reason(arm_result: dict, kind: str) -> str:
    """Why an arm that did not fail has no headline figure: its decode window was never reached, or the row that
    holds the figure (latency's batch_1, long's longest prompt) recorded an error (the time limit came before a
    decode step)."""
    if (arm_result.get("decode_window") or {}).get("reason"):
        return "no decode window: " + arm_result["decode_window"]["reason"]
    if kind == "latency" and "error" in (arm_result.get("batch_1") or {}):
        return f"batch_1: {arm_result['batch_1']['error']}"
    rows = sorted((k for k in arm_result if k.startswith("prompt_")), key=lambda k: int(k[len("prompt_"):]))
    if kind == "long" and rows:  # the figure is the longest prompt's decode rate
        row = arm_result[rows[-1]]
        return f"{rows[-1]}: {row.get('error') or 'fewer than 2 output tokens within the time limit'}"
    return ""


def format_table(result: dict) -> str:
    """A plain-text table of the headline figure per arm (what gpu_check.sh prints last)."""
    kind = result["workload"]["kind"]
    lines = [f"{result['config']} {kind} ({device_label(result['environment'])}, {result['date']})",
             f"{'arm':<8} {HEADLINES[kind][1]:>36}  notes"]
    for arm, r in result["arms"].items():
        value = headline(r, kind)
        errors = r.get("error") or "; ".join(r.get("errors") or [])
        if errors:
            note = "failed: " + errors[:60]
        elif r.get("skipped"):  # why the arm has no figure (the hf arm on latency, or with FP8 settings)
            note = "skipped: " + r["skipped"]
        else:
            note = ", ".join(filter(None, ["truncated" if r.get("truncated") else "", _no_figure_reason(r, kind)
                                           if value is None else ""]))
        shown = f"{value:,.1f}" if value is not None else "-"
        lines.append(f"{arm:<8} {shown:>36}  {note}")
    for name, value in result.get("ratios", {}).items():
        lines.append(f"{name:<16} {value}")
    return "\n".join(lines)
