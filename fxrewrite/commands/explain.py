"""`fxrewrite explain [MODEL]`: what `optimize` fuses in a model, what it refuses and why, and the diffs.

The model is built from its config with parameters on the meta device (no weights are read), so
this is fast even for large models; rotary buffers are real, as in the serving engine.
"""

from __future__ import annotations

import argparse

from fxrewrite.commands.engine_args import StoreOnce, add_model_argument, parse_hf_overrides


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_argument(parser)
    parser.add_argument("--hf-overrides", type=parse_hf_overrides, default=None, action=StoreOnce,
                        help='JSON dict applied to the config, e.g. \'{"rope_parameters": {...}}\'')
    parser.add_argument("--revision", default=None, help="branch, tag or commit of a hub id MODEL (default: the latest)")
    parser.add_argument("--download-dir", default=None,
                        help="folder of the Hugging Face hub cache a hub id MODEL is read from and downloaded into "
                             "(default: the HF cache, HF_HUB_CACHE); a local folder ignores it")
    parser.add_argument("--no-diff", action="store_true", help="print the report table only")
    parser.add_argument("--trust-remote-code", action="store_true", help="allow custom modeling code")


def run(args: argparse.Namespace) -> int:
    import torch
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    import fxrewrite
    from fxrewrite.runtime.model_files.config import ModelConfig

    config = ModelConfig.from_pretrained(args.model, hf_overrides=args.hf_overrides, revision=args.revision,
                                         download_dir=args.download_dir, trust_remote_code=args.trust_remote_code)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config.hf_config, dtype=torch.float32,
                                                 trust_remote_code=args.trust_remote_code)
    fxrewrite.optimize(model.eval())
    report = fxrewrite.explain(model)
    print(report)
    diff = report.diff()
    if diff and not args.no_diff:
        print("\nsource edits, original vs rewritten forward (--no-diff hides them):")
        print(diff, end="")
    return 0
