"""Fine-tune a causal LM with transformers.Trainer after `fxrewrite.optimize` (runs on a CPU in under a minute).

    python examples/train_trainer.py                    # the default model (SmolLM2-135M-Instruct), 4 steps
    python examples/train_trainer.py --model ./my-model --max-steps 100 --bf16

The one fxrewrite line is `fxrewrite.optimize(model)`: fused RMSNorm / rotary / gated-MLP kernels with
backward passes, and the fused linear cross-entropy (while training with labels, outputs.logits is None:
the [tokens, vocab] logits are never built). It saves no checkpoint (save_strategy="no"); one saved with
`trainer.save_model()` or `model.save_pretrained()` has Hugging Face names and loads in plain transformers.
"""

from __future__ import annotations

import argparse

import torch
import transformers

import fxrewrite

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention stores the KV cache in fixed-size blocks.",
    "RMSNorm divides by the root mean square of the features.",
    "Rotary embeddings rotate pairs of features by position-dependent angles.",
] * 8


class TextDataset(torch.utils.data.Dataset):
    """Tokenised sentences as {input_ids, attention_mask, labels}, padded to one length."""

    def __init__(self, tokenizer, texts, max_length: int = 32):
        enc = tokenizer(texts, padding="max_length", truncation=True, max_length=max_length, return_tensors="pt")
        self.items = []
        for ids, mask in zip(enc["input_ids"], enc["attention_mask"]):
            labels = ids.masked_fill(mask == 0, -100)  # no loss on padding
            self.items.append({"input_ids": ids, "attention_mask": mask, "labels": labels})

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model folder or hub id (default: the default model)")
    parser.add_argument("--max-steps", type=int, default=4)
    parser.add_argument("--output-dir", default="/tmp/fxrewrite-trainer")
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    args = parser.parse_args(argv)
    if args.model is None:
        from fxrewrite.runtime.model_files.default_model import default_model_path

        args.model = str(default_model_path())
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.model)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    model = fxrewrite.optimize(model)
    # transformers 5.17 spells it gradient_checkpointing; newer 5.x activation_checkpointing (the old name warns)
    fields = transformers.TrainingArguments.__dataclass_fields__
    checkpointing = "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"
    training_args = transformers.TrainingArguments(
        output_dir=args.output_dir, max_steps=args.max_steps, per_device_train_batch_size=4, learning_rate=1e-4,
        logging_steps=1, save_strategy="no", report_to=[], bf16=args.bf16, use_cpu=not torch.cuda.is_available(),
        dataloader_num_workers=0, **{checkpointing: args.gradient_checkpointing})
    trainer = transformers.Trainer(model=model, args=training_args, train_dataset=TextDataset(tokenizer, TEXTS))
    out = trainer.train()
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    print(f"steps {out.global_step}, losses {[round(x, 4) for x in losses]}")
    print("fused:", ", ".join(fxrewrite.explain(model).applied_patterns()))
    return {"global_step": out.global_step, "losses": losses}


if __name__ == "__main__":
    main()
