"""`fxrewrite bench rl`: GRPO iterations with engine rollouts against stock `generate` rollouts, weight-sync
timings, and the engine-vs-trainer logprob gap.

One iteration = rollouts of `num_prompts` x `samples` completions (`max_tokens` each, EOS ignored, so both
arms produce the same number of tokens), a reward per completion, GRPO advantages, the clipped loss over
every completion token in micro-batches, one AdamW step, and (engine arm) `llm.load_weights(model)`.
Arms:
- "engine": rollouts with `fxrewrite.LLM` (the transformers model rewritten by fxrewrite, paged KV, CUDA
  graphs), the engine's sampled-token logprobs as the old policy; time = generate + train + sync.
- "hf": rollouts with the trainer's own model through transformers' `generate` (batches of `hf_batch`
  rows, KV cache, sampling), no second copy and no sync; the old logprobs are the new ones detached
  (TRL's single-step GRPO does the same); time = generate + train.
Both train the same `fxrewrite.optimize`d model from the same random init (no weights exist here).
Also recorded: after the engine arm, `sleep(level=1)` / `wake_up()` seconds and the CUDA-graph capture
inside wake_up; `logprob_agreement`, the engine's old logprobs against the trainer's recomputation on the
same weights (mean / max absolute difference, bitwise-equal fraction; `batch_invariant`: both sides in
batch-invariant mode, where the fraction should be 1).
Weights: random (`transformers`' init) in the bench config's shapes, bf16 on a GPU, float32 on a CPU.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from fxrewrite.benchmarks.common import bench_model_dir, environment, free_device_memory, load_bench_config
from fxrewrite.compiler import optimize
from fxrewrite.kernels.batch_invariant import batch_invariant_mode
from fxrewrite.rl import completion_grpo_loss, grpo_advantages
from fxrewrite.runtime.engine.sampling_params import SamplingParams
from fxrewrite.runtime.llm import LLM
from fxrewrite.runtime.worker import sleep_mode


def _timed(fn, reps: int, device) -> list[float]:
    """Seconds of each of `reps` calls of `fn`, the device synchronised before and after each."""
    times = []
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return times


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def build_trainer(model_dir: Path, device: str, dtype: torch.dtype, seed: int = 0):
    """The trainable model: transformers' random init from the folder's config, optimized, in train mode."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=dtype)
    return optimize(model).train()


def make_prompts(tokenizer, num: int) -> list[list[int]]:
    """`num` short arithmetic questions as token ids (about 15-20 tokens each)."""
    return [tokenizer.encode(f"Question {i}: what is {i % 97} plus {(7 * i) % 89}? Answer:") for i in range(num)]


def reward(completion: list[int], max_tokens: int) -> float:
    """Distinct tokens over max_tokens: varies within a group, which is all the timing needs."""
    return len(set(completion)) / max_tokens


def micro_batches(prompts, completions, micro_batch: int, micro_batch_tokens: int | None) -> list[slice]:
    """Consecutive slices of at most `micro_batch` sequences and, when `micro_batch_tokens` is given, at most
    that many padded tokens (rows x longest prompt + completion): the training forward's activation memory
    grows with the padded tokens, so the budget sets it whatever the lengths."""
    out, s = [], 0
    while s < len(prompts):
        e, width = s, 0
        while e < len(prompts) and e - s < micro_batch:
            w = max(width, len(prompts[e]) + len(completions[e]))
            if micro_batch_tokens and e > s and (e - s + 1) * w > micro_batch_tokens:
                break
            e, width = e + 1, w
        out.append(slice(s, e))
        s = e
    return out


class PhaseClock:
    """Seconds per named phase of a step without synchronising inside it: CUDA events on a GPU (read once,
    by `seconds()`, after the step), wall-clock marks on a CPU. `mark(name)` closes the phase running since
    the previous mark (or `start()`) and books it under `name`."""

    def __init__(self, device: str):
        self.cuda = str(device).startswith("cuda")
        self.marks: list[tuple[str, object]] = []

    def _now(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def start(self) -> None:
        self.marks = [("", self._now())]

    def mark(self, name: str) -> None:
        self.marks.append((name, self._now()))

    def seconds(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for (_, a), (name, b) in zip(self.marks, self.marks[1:]):
            dt = a.elapsed_time(b) / 1e3 if self.cuda else b - a
            out[name] = out.get(name, 0.0) + dt
        return out


def train_step(model, optimizer, prompts, completions, old, rewards, samples: int, micro_batch: int,
               invariant: bool = False, micro_batch_tokens: int | None = None) -> dict:
    """One GRPO optimizer step over the rollouts (gradients accumulated per micro-batch, weighted by tokens).
    The logprob gap to the old policy is gathered on the device and read once, after the step; so are the
    seconds of its phases (`train_phases_s`: forward = logprobs + loss, backward, optimizer)."""
    device = str(next(model.parameters()).device)
    clock = PhaseClock(device)
    clock.start()
    adv = grpo_advantages(torch.tensor(rewards), samples)
    total = sum(map(len, completions))
    optimizer.zero_grad(set_to_none=True)
    losses, gap = [], []
    batches = micro_batches(prompts, completions, micro_batch, micro_batch_tokens)
    for sl in batches:
        with batch_invariant_mode(invariant):  # old None: on-policy, the ratio is 1 (TRL's single step)
            loss, new = completion_grpo_loss(model, prompts[sl], completions[sl], adv[sl],
                                             None if old is None else old[sl], micro_batch_size=sl.stop - sl.start)
        loss = loss * (sum(map(len, completions[sl])) / total)
        clock.mark("forward")
        loss.backward()
        clock.mark("backward")
        losses.append(loss.detach())
        if old is not None:
            gap.append((torch.cat(new).float() - torch.cat(old[sl]).float().to(new[0].device)).abs())
    optimizer.step()
    clock.mark("optimizer")
    _sync(device)
    padded = sum((sl.stop - sl.start) * max(len(p) + len(c) for p, c in zip(prompts[sl], completions[sl]))
                 for sl in batches)
    out = {"loss": float(torch.stack(losses).sum()), "train_phases_s": clock.seconds(),
           "micro_batches": len(batches), "padded_tokens": padded,
           "tokens": sum(len(p) + len(c) for p, c in zip(prompts, completions))}
    if gap:
        gaps = torch.cat(gap)
        out.update(logprob_abs_diff_mean=float(gaps.mean()), logprob_abs_diff_max=float(gaps.max()),
                   logprob_bitwise_equal_fraction=float((gaps == 0).float().mean()))
    if not bool(adv.any()):  # every group's rewards equal: a zero loss gradient, so the weights did not move
        out["note"] = ("every advantage was 0 (each group's rewards were equal): this step changed no weight, so "
                       "the sync and log-prob figures after it measure an unchanged model")
        print(f"[bench rl] warning: {out['note']}", flush=True)
    return out


def engine_rollouts(llm, prompts, samples: int, max_tokens: int):
    # Unseeded: a seeded request draws its noise row by row from its own generator.
    # the reward reads token ids, so no text is made (detokenize=False)
    params = SamplingParams(n=samples, temperature=1.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0,
                            detokenize=False)
    outs = llm.generate(prompts, params, use_tqdm=False)
    ps, cs, lps = [], [], []
    for o in outs:
        for c in o.outputs:
            ps.append(list(o.prompt_token_ids))
            cs.append(list(c.token_ids))
            lps.append(torch.tensor([step[t].logprob for t, step in zip(c.token_ids, c.logprobs)], dtype=torch.float32))
    return ps, cs, lps


@torch.no_grad()
def hf_rollouts(model, prompts, samples: int, max_tokens: int, batch_rows: int, pad_id: int):
    """`generate` with sampling over left-padded batches of `batch_rows` completions."""
    model.eval()
    ps, cs = [], []
    rows = [p for p in prompts for _ in range(samples)]
    device = next(model.parameters()).device
    for s in range(0, len(rows), batch_rows):
        chunk = rows[s:s + batch_rows]
        width = max(map(len, chunk))
        ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(chunk):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        out = model.generate(ids.to(device), attention_mask=mask.to(device), do_sample=True, temperature=1.0,
                             top_k=0, max_new_tokens=max_tokens, min_new_tokens=max_tokens, pad_token_id=pad_id)
        ps += chunk
        cs += out[:, width:].tolist()
    model.train()
    return ps, cs, None


def run_iterations(arm: str, model_dir: Path, args: dict, device: str, dtype: torch.dtype) -> dict:
    """`iterations` GRPO iterations of one arm; per-iteration seconds of generate / train / sync."""
    model = build_trainer(model_dir, device, dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    llm = None
    if arm == "engine":
        llm = LLM(str(model_dir), model_impl="transformers", load_format="dummy", device=device,
                  dtype=str(dtype).removeprefix("torch."), gpu_memory_utilization=args["gpu_memory_utilization"],
                  max_model_len=args["max_model_len"], max_num_seqs=args.get("max_num_seqs", 256), seed=0,
                  batch_invariant=args["batch_invariant"])
        llm.load_weights(model)
    tokenizer = llm.get_tokenizer() if llm else _tokenizer(model_dir)
    prompts = make_prompts(tokenizer, args["num_prompts"])
    iterations = []
    for it in range(args["iterations"]):
        t0 = time.perf_counter()
        if llm is not None:
            ps, cs, old = engine_rollouts(llm, prompts, args["samples"], args["max_tokens"])
        else:
            ps, cs, old = hf_rollouts(model, prompts, args["samples"], args["max_tokens"], args["hf_batch"],
                                      tokenizer.pad_token_id or 0)
        _sync(device)
        t1 = time.perf_counter()
        rewards = [reward(c, args["max_tokens"]) for c in cs]
        stats = train_step(model, optimizer, ps, cs, old, rewards, args["samples"], args["micro_batch"],
                           args["batch_invariant"], args.get("micro_batch_tokens"))
        _sync(device)
        t2 = time.perf_counter()
        if llm is not None:
            llm.load_weights(model)
            _sync(device)
        t3 = time.perf_counter()
        iterations.append({"generate_s": t1 - t0, "train_s": t2 - t1, "sync_s": t3 - t2, "total_s": t3 - t0,
                           "completion_tokens": sum(map(len, cs)), "mean_reward": sum(rewards) / len(rewards),
                           **stats})
    out = {"iterations": iterations}
    if llm is not None:
        out["sleep_wake_up"] = time_sleep_wake_up(llm, device)
    del llm, model, optimizer
    free_device_memory()
    return out


def time_sleep_wake_up(llm, device: str) -> dict:
    """Seconds of `llm.sleep(level=1)` and `llm.wake_up()`, and of the decode CUDA-graph capture inside
    wake_up (the restored memory has new addresses, so the graphs are captured again)."""
    capture: list[float] = []
    original = sleep_mode.build_graph_runner

    def timed_capture(*args, **kwargs):
        t0 = time.perf_counter()
        runner = original(*args, **kwargs)
        _sync(device)
        capture.append(time.perf_counter() - t0)
        return runner

    sleep_mode.build_graph_runner = timed_capture
    try:
        sleep_s = _timed(lambda: llm.sleep(level=1), 1, device)[0]
        wake_s = _timed(llm.wake_up, 1, device)[0]
    finally:
        sleep_mode.build_graph_runner = original
    graphs = llm.llm_engine.model_runner.graph_runner
    return {"sleep_s": sleep_s, "wake_up_s": wake_s, "graph_capture_s": capture[0] if capture else None,
            "num_graphs": len(graphs.graphs) if graphs is not None else 0}


def _tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def time_weight_sync(model_dir: Path, device: str, dtype: torch.dtype, reps: int = 5) -> dict:
    """Seconds of `llm.load_weights` from an optimized model (fused names: one copy per fused tensor) and from
    Hugging Face names (copied into their shards), beside one device copy of the same bytes."""
    model = build_trainer(model_dir, device, dtype).eval()
    llm = LLM(str(model_dir), model_impl="transformers", load_format="dummy", device=device,
              dtype=str(dtype).removeprefix("torch."), kv_cache_memory_bytes=256 << 20, max_model_len=1024,
              enforce_eager=True)
    fused = [(n, p.detach()) for n, p in model.named_parameters()]
    hf_names = list(model.state_dict().items())  # the split hooks give transformers' names
    nbytes = sum(t.numel() * t.element_size() for _, t in fused)
    out = {"num_fused_tensors": len(fused), "num_hf_tensors": len(hf_names), "bytes": nbytes}
    for key, weights in (("fused", fused), ("hf_names", hf_names)):
        llm.load_weights(weights)  # warm-up
        times = _timed(lambda: llm.load_weights(weights), reps, device)
        out[f"{key}_s"] = {"min": min(times), "median": sorted(times)[len(times) // 2]}
    flat = torch.empty(nbytes, dtype=torch.uint8, device=device)
    copy = torch.empty_like(flat)
    out["one_device_copy_s"] = min(_timed(lambda: copy.copy_(flat), reps, device))
    del llm, model, fused, hf_names, flat, copy
    free_device_memory()
    return out


def run_rl_bench(config: str, arms: list[str], sync_configs: list[str], out_dir: Path, device: str | None = None,
                 tokenizer_dir: Path | None = None, notes: list[str] | None = None, **args) -> dict:
    """Every arm's GRPO iterations, the weight-sync timings of `sync_configs`, one JSON in `out_dir`
    (`<date>-<config>-rl.json`; `-rl-bi.json` in batch-invariant mode, `-rl-sync.json` with no arms: the
    sync timings alone, no model of `config` is trained). `args`: num_prompts, samples, max_tokens,
    iterations, micro_batch, micro_batch_tokens, hf_batch, max_model_len, max_num_seqs, gpu_memory_utilization, batch_invariant."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    spec = load_bench_config(config)
    model_dir = bench_model_dir(spec, tokenizer_dir)
    result = {"config": spec["name"], "device": device, "dtype": str(dtype), "settings": args, "notes": notes or [],
              "environment": environment(), "arms": {}, "weight_sync": {}}
    suffix = "-bi" if args.get("batch_invariant") else ("" if arms else "-sync")
    path = out_dir / f"{result['environment']['date'][:10]}-{spec['name']}-rl{suffix}.json"
    out_dir.mkdir(parents=True, exist_ok=True)
    for arm in arms:  # the JSON is rewritten after each part, so a run cut short keeps what it measured
        result["arms"][arm] = run_iterations(arm, model_dir, args, device, dtype)
        path.write_text(json.dumps(result, indent=2) + "\n")
    for name in sync_configs:
        sync_spec = load_bench_config(name)
        result["weight_sync"][sync_spec["name"]] = time_weight_sync(bench_model_dir(sync_spec, tokenizer_dir), device, dtype)
    if "engine" in arms:
        its = result["arms"]["engine"]["iterations"]
        result["logprob_agreement"] = {
            "batch_invariant": bool(args.get("batch_invariant")), "dtype": str(dtype),
            "what": "engine's sampled-token logprobs vs the trainer's recomputation, same weights, before the step",
            "abs_diff_mean": sum(it["logprob_abs_diff_mean"] for it in its) / len(its),
            "abs_diff_max": max(it["logprob_abs_diff_max"] for it in its),
            "bitwise_equal_fraction": min(it["logprob_bitwise_equal_fraction"] for it in its)}
    if {"engine", "hf"} <= set(arms):
        last = {arm: result["arms"][arm]["iterations"][-1]["total_s"] for arm in ("engine", "hf")}
        result["speedup_last_iteration"] = last["hf"] / last["engine"]
        # Amdahl: the train step is the same in both arms, so even free rollouts give at most this
        eng = result["arms"]["engine"]["iterations"][-1]
        result["speedup_bound_free_rollouts"] = last["hf"] / (eng["train_s"] + eng["sync_s"])
    path.write_text(json.dumps(result, indent=2) + "\n")
    result["files"] = [str(path)]
    return result


def format_rl_table(result: dict) -> str:
    """Per arm and iteration: generate / train / sync / total seconds; then the sync timings."""
    lines = [f"{'arm':8} {'it':>3} {'generate s':>11} {'train s':>9} {'sync s':>8} {'total s':>9} {'lp |diff|':>10}"]
    for arm, data in result["arms"].items():
        for i, it in enumerate(data["iterations"]):
            diff = it.get("logprob_abs_diff_mean")
            lines.append(f"{arm:8} {i:>3} {it['generate_s']:>11.3f} {it['train_s']:>9.3f} {it['sync_s']:>8.4f} "
                         f"{it['total_s']:>9.3f} {'' if diff is None else f'{diff:.2e}':>10}")
    for arm, data in result["arms"].items():
        last = data["iterations"][-1]
        if "train_phases_s" in last:
            phases = ", ".join(f"{k} {v:.3f} s" for k, v in last["train_phases_s"].items())
            lines.append(f"{arm} train step (last iteration): {phases}; {last['micro_batches']} micro-batches, "
                         f"{last['padded_tokens']} padded tokens for {last['tokens']}")
    for name, s in result["weight_sync"].items():
        lines.append(f"sync {name}: fused {s['fused_s']['min'] * 1e3:.2f} ms, HF names {s['hf_names_s']['min'] * 1e3:.2f} ms, "
                     f"one device copy {s['one_device_copy_s'] * 1e3:.2f} ms ({s['bytes'] / 2**20:.0f} MiB)")
    for arm, data in result["arms"].items():
        if "sleep_wake_up" in data:
            sw = data["sleep_wake_up"]
            capture = sw["graph_capture_s"]
            lines.append(f"{arm}: sleep {sw['sleep_s']:.3f} s, wake_up {sw['wake_up_s']:.3f} s (CUDA graph capture "
                         f"{'-' if capture is None else f'{capture:.3f} s'}, {sw['num_graphs']} graphs)")
    if "logprob_agreement" in result:
        la = result["logprob_agreement"]
        lines.append(f"logprobs engine vs trainer (batch_invariant={la['batch_invariant']}): mean |diff| "
                     f"{la['abs_diff_mean']:.3e}, max {la['abs_diff_max']:.3e}, bitwise equal {la['bitwise_equal_fraction']:.4f}")
    if "speedup_last_iteration" in result:
        lines.append(f"whole iteration, hf / engine: {result['speedup_last_iteration']:.2f}x (bound with free engine "
                     f"rollouts, the same train step: {result['speedup_bound_free_rollouts']:.2f}x)")
    return "\n".join(lines)
