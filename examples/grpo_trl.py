"""TRL's GRPOTrainer with fxrewrite's engine for the rollouts, through TRL's `rollout_func` hook (CPU-sized).

    pip install 'fxrewrite[train]'          # TRL >= the release with GRPOTrainer(rollout_func=...), e.g. 1.16
    python examples/grpo_trl.py             # the default model (SmolLM2-135M-Instruct), 2 steps
    python examples/grpo_trl.py --model ./my-model --max-steps 50

`GRPOTrainer(rollout_func=...)` (documented in its docstring, marked experimental by TRL) hands each
process's prompts to a function that returns `prompt_ids`, `completion_ids` and `logprobs`; with
`use_vllm=False` TRL neither builds vLLM nor moves weights. `engine_rollout_func(llm)` below fills that
hook with an `fxrewrite.LLM`: before sampling it copies the trainer's weights into the engine when the
optimizer has stepped since the last sync (`llm.load_weights(trainer.model)`, one copy per fused tensor),
then samples `num_generations` completions per prompt with `SamplingParams(n=..., logprobs=0)`. The trainer
model is the same `fxrewrite.optimize`d model TRL trains. TRL recomputes the logprobs for the loss itself;
the engine's go back as the sampling logprobs (used by TRL only for vLLM's importance-sampling correction).
"""

from __future__ import annotations

import argparse
import inspect
from itertools import groupby

import torch
import transformers

import fxrewrite
from fxrewrite import LLM, SamplingParams

QUESTIONS = [f"What is {a} + {b}? Reply with the number only." for a, b in ((2, 3), (7, 5), (11, 4), (6, 9))]


def engine_rollout_func(llm: LLM):
    """A `rollout_func(prompts, trainer) -> dict` for TRL's GRPOTrainer that samples with `llm`.

    `prompts`: the trainer's per-process slice (strings, or chat message lists; TRL's sampler repeats each
    prompt `num_generations` times in a row, so each run of equal prompts is sampled once with n = its
    length). Returns one prompt_ids / completion_ids / logprobs list per completion, in the input order."""
    synced_step = [0]  # the engine was given the trainer's initial weights

    def rollout(prompts: list, trainer) -> dict:
        if trainer.state.global_step != synced_step[0]:
            llm.load_weights(trainer.model)
            synced_step[0] = trainer.state.global_step
        runs = [(prompt, len(list(group))) for prompt, group in groupby(prompts)]
        outs = []
        for prompt, n in runs:
            params = SamplingParams(n=n, temperature=trainer.temperature, max_tokens=trainer.max_completion_length,
                                    logprobs=0)
            if isinstance(prompt, list):  # chat messages: the engine applies the chat template
                outs += llm.chat([prompt], params, use_tqdm=False)
            else:
                outs += llm.generate([prompt], params, use_tqdm=False)
        result = {"prompt_ids": [], "completion_ids": [], "logprobs": []}
        for out in outs:
            for c in out.outputs:
                result["prompt_ids"].append(list(out.prompt_token_ids))
                result["completion_ids"].append(list(c.token_ids))
                result["logprobs"].append([step[t].logprob for t, step in zip(c.token_ids, c.logprobs)])
        return result

    return rollout


def reward_answer(completions, prompts, **kwargs) -> list[float]:
    """1 when the completion holds the sum asked for, else 0."""
    out = []
    for prompt, completion in zip(prompts, completions):
        question = prompt[-1]["content"] if isinstance(prompt, list) else prompt
        text = completion[-1]["content"] if isinstance(completion, list) else completion
        a, b = (int(x) for x in question.split("What is ")[1].split("?")[0].split(" + "))
        out.append(float(str(a + b) in text))
    return out


def main(argv=None) -> dict:
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model folder (default: the default model)")
    parser.add_argument("--max-steps", type=int, default=2)
    parser.add_argument("--num-generations", type=int, default=4)
    parser.add_argument("--max-completion-length", type=int, default=16)
    parser.add_argument("--output-dir", default="/tmp/fxrewrite-grpo-trl")
    args = parser.parse_args(argv)
    if "rollout_func" not in inspect.signature(GRPOTrainer).parameters:
        raise SystemExit("this TRL has no GRPOTrainer(rollout_func=...); upgrade trl (1.16 has it)")
    if args.model is None:
        from fxrewrite.runtime.model_files.default_model import default_model_path

        args.model = str(default_model_path())
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.model)
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(device)
    model = fxrewrite.optimize(model)
    llm = LLM(args.model, model_impl="transformers", dtype=str(dtype).removeprefix("torch."), device=device,
              load_format="dummy", gpu_memory_utilization=0.3, max_model_len=512)
    llm.load_weights(model)  # the engine starts from the trainer's weights
    chat = tokenizer.chat_template is not None
    rows = [{"prompt": [{"role": "user", "content": q}] if chat else q} for q in QUESTIONS]
    config = GRPOConfig(output_dir=args.output_dir, max_steps=args.max_steps, learning_rate=1e-5,
                        per_device_train_batch_size=args.num_generations, num_generations=args.num_generations,
                        max_completion_length=args.max_completion_length, use_vllm=False, logging_steps=1,
                        save_strategy="no", report_to=[], use_cpu=device == "cpu", bf16=device == "cuda",
                        dataloader_num_workers=0)
    trainer = GRPOTrainer(model=model, reward_funcs=reward_answer, args=config, train_dataset=Dataset.from_list(rows),
                          processing_class=tokenizer, rollout_func=engine_rollout_func(llm))
    out = trainer.train()
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    print(f"steps {out.global_step}, losses {[round(x, 4) for x in losses]}")
    return {"global_step": out.global_step, "losses": losses}


if __name__ == "__main__":
    main()
