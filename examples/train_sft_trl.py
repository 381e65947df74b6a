"""Supervised fine-tuning with TRL's SFTTrainer on a model passed through `fxrewrite.optimize` (CPU-sized).

    pip install 'fxrewrite[train]'
    python examples/train_sft_trl.py                      # the default model (SmolLM2-135M-Instruct), 4 steps
    python examples/train_sft_trl.py --model ./my-model --max-steps 100

SFTTrainer takes the optimized model object as is; the loss goes through fxrewrite's fused linear
cross-entropy (outputs.logits is None while training with labels), so TRL's token-accuracy metric,
which needs logits, is turned off here.
"""

from __future__ import annotations

import argparse

import torch
import transformers

import fxrewrite

CONVERSATIONS = [
    [{"role": "user", "content": "What is paged attention?"},
     {"role": "assistant", "content": "A KV cache stored in fixed-size blocks, found through a block table."}],
    [{"role": "user", "content": "What does RMSNorm compute?"},
     {"role": "assistant", "content": "x divided by the root mean square of its features, times a weight."}],
] * 8


def main(argv=None) -> dict:
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model folder or hub id (default: the default model)")
    parser.add_argument("--max-steps", type=int, default=4)
    parser.add_argument("--output-dir", default="/tmp/fxrewrite-sft")
    args = parser.parse_args(argv)
    if args.model is None:
        from fxrewrite.runtime.model_files.default_model import default_model_path

        args.model = str(default_model_path())
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.model)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = fxrewrite.optimize(transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32))
    if tokenizer.chat_template is None:
        texts = [{"text": " ".join(m["content"] for m in conv)} for conv in CONVERSATIONS]
        dataset = Dataset.from_list(texts)
    else:
        dataset = Dataset.from_list([{"messages": conv} for conv in CONVERSATIONS])
    config = SFTConfig(output_dir=args.output_dir, max_steps=args.max_steps, per_device_train_batch_size=4,
                       learning_rate=1e-4, logging_steps=1, save_strategy="no", report_to=[], max_length=64,
                       use_cpu=not torch.cuda.is_available(), dataloader_num_workers=0)
    if hasattr(config, "compute_token_accuracy"):  # needs logits, which the fused loss does not build
        config.compute_token_accuracy = False
    trainer = SFTTrainer(model=model, args=config, train_dataset=dataset, processing_class=tokenizer)
    out = trainer.train()
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    print(f"steps {out.global_step}, losses {[round(x, 4) for x in losses]}")
    print("fused:", ", ".join(fxrewrite.explain(model).applied_patterns()))
    return {"global_step": out.global_step, "losses": losses}


if __name__ == "__main__":
    main()
