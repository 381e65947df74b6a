"""GRPO in one process: train with `fxrewrite.optimize(model)`, sample with `fxrewrite.LLM`, sync in place.

    python examples/grpo.py                          # the default model (SmolLM2-135M-Instruct), CPU, minutes
    python examples/grpo.py --bench-config qwen3-0.6b --prompts 64 --samples 8 --max-tokens 64 --sleep   # GPU

Each iteration: the engine samples `samples` answers per question (their logprobs come back with
`SamplingParams(logprobs=0)`), a string check scores them (1 when the answer holds the right number,
minus a small length term), GRPO turns the scores into group-relative advantages, the optimized model
takes one AdamW step on the clipped loss (old policy = the engine's logprobs, which equal the trainer's
recomputation: the printed |lp diff|), and `llm.load_weights(model)` copies the new weights into the
engine in place, one copy per fused tensor. With --sleep (GPU) the engine frees its KV cache and weights
while the trainer steps (`llm.sleep(level=2)`), then takes the weights back first and the cache after.
`--bench-config` trains a randomly initialised model of a bench config's shapes (no weights download).
"""

from __future__ import annotations

import argparse
import random
import time

import torch

import fxrewrite
from fxrewrite import LLM, SamplingParams
from fxrewrite.rl import completion_grpo_loss, grpo_advantages


def questions(n: int, seed: int) -> list[tuple[str, str]]:
    """(question, answer) pairs of small additions."""
    rng = random.Random(seed)
    pairs = [(rng.randint(1, 20), rng.randint(1, 20)) for _ in range(n)]
    return [(f"What is {a} + {b}? Reply with the number only.", str(a + b)) for a, b in pairs]


def score(text: str, answer: str, num_tokens: int) -> float:
    return float(answer in text) - 0.002 * num_tokens


def load(args):
    """(model folder, trainer model, engine). The engine starts from the trainer's weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if args.bench_config:
        from fxrewrite.benchmarks.common import bench_model_dir, load_bench_config

        path = str(bench_model_dir(load_bench_config(args.bench_config)))
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=dtype)
    else:
        from fxrewrite.runtime.model_files.default_model import default_model_path

        path = args.model or str(default_model_path())
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
    model = fxrewrite.optimize(model).train()
    llm = LLM(path, model_impl="transformers", dtype=str(dtype).removeprefix("torch."), device=device,
              load_format="dummy", gpu_memory_utilization=args.gpu_memory_utilization, max_model_len=1024)
    llm.load_weights(model)  # the engine's random weights become the trainer's
    return model, llm


def train_step(model, optimizer, prompts, completions, old, rewards, samples, micro_batch):
    """One optimizer step; returns (loss, mean |engine logprob - trainer logprob|)."""
    adv = grpo_advantages(torch.tensor(rewards), samples)
    total = sum(map(len, completions))
    optimizer.zero_grad(set_to_none=True)
    loss_sum, diffs = 0.0, []
    for s in range(0, len(prompts), micro_batch):
        # the clipped loss over the micro-batch's tokens and the new logprobs (detached), in one forward
        loss, new = completion_grpo_loss(model, prompts[s:s + micro_batch], completions[s:s + micro_batch],
                                         adv[s:s + micro_batch], old[s:s + micro_batch])
        diffs += [(n.float().cpu() - o).abs() for n, o in zip(new, old[s:s + micro_batch])]
        loss = loss * sum(map(len, completions[s:s + micro_batch])) / total
        loss.backward()
        loss_sum += float(loss.detach())
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return loss_sum, float(torch.cat(diffs).mean())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="model folder or hub id (default: the built-in default model)")
    p.add_argument("--bench-config", default=None, help="random weights in a bench config's shapes (qwen3-0.6b)")
    p.add_argument("--iterations", type=int, default=3)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--samples", type=int, default=4, help="completions per prompt (the GRPO group)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--sleep", action="store_true", help="free the engine's memory while training (GPU)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.4)
    p.add_argument("--device", default=None)
    args = p.parse_args()
    model, llm = load(args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    params = SamplingParams(n=args.samples, temperature=1.0, max_tokens=args.max_tokens, logprobs=0)
    for it in range(args.iterations):
        batch = questions(args.prompts, seed=it)
        t0 = time.perf_counter()
        outs = llm.chat([[{"role": "user", "content": q}] for q, _ in batch], params, use_tqdm=False)
        prompts, completions, old, rewards = [], [], [], []
        for (_, answer), out in zip(batch, outs):
            for c in out.outputs:
                prompts.append(list(out.prompt_token_ids))
                completions.append(list(c.token_ids))
                old.append(torch.tensor([step[t].logprob for t, step in zip(c.token_ids, c.logprobs)]))
                rewards.append(score(c.text, answer, len(c.token_ids)))
        t1 = time.perf_counter()
        if args.sleep:
            llm.sleep(level=2)  # KV cache and weights freed: the trainer has the memory
        loss, lp_diff = train_step(model, optimizer, prompts, completions, old, rewards, args.samples,
                                   args.micro_batch)
        t2 = time.perf_counter()
        if args.sleep:
            llm.wake_up(tags=["weights"])
        llm.load_weights(model)
        if args.sleep:
            llm.wake_up(tags=["kv_cache"])
        t3 = time.perf_counter()
        print(f"iteration {it}: reward {sum(rewards) / len(rewards):+.3f}  loss {loss:+.4f}  "
              f"|lp diff| {lp_diff:.1e}  generate {t1 - t0:.2f} s  train {t2 - t1:.2f} s  sync {t3 - t2:.3f} s")
    print("sample:", repr(outs[0].outputs[0].text))


if __name__ == "__main__":
    main()
