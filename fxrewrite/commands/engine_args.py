"""The engine flags shared by `serve`, `generate`, `chat` and `bench`, spelled as vLLM spells them.

`add_engine_arguments(parser)` adds them; `engine_kwargs(args)` turns the parsed namespace into the
keyword arguments of `fxrewrite.runtime.llm.LLM` (and `LLMEngine`). Nothing heavy is imported here.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from fxrewrite.errors import UserInputError
from fxrewrite.runtime.engine_config import COMPILATION_LEVELS, KV_CACHE_DTYPES

# Flags whose value is an `LLM(...)` keyword argument of the same name (dest == kwarg).
ENGINE_KWARG_NAMES = (
    "max_logprobs",
    "trust_remote_code",
    "revision",
    "download_dir",
    "tokenizer",
    "model_impl",
    "fusion",
    "hf_overrides",
    "max_model_len",
    "dtype",
    "seed",
    "max_num_seqs",
    "max_num_batched_tokens",
    "block_size",
    "enable_prefix_caching",
    "gpu_memory_utilization",
    "kv_cache_memory_bytes",
    "enforce_eager",
    "compilation_config",
    "async_scheduling",
    "tensor_parallel_size",
    "data_parallel_size",
    "enable_expert_parallel",
    "pipeline_parallel_size",
    "quantization",
    "kv_cache_dtype",
    "load_format",
    "batch_invariant",
)

# vLLM: lowercase suffixes are powers of 1000, uppercase of 1024 ("32k" = 32000, "32K" = 32768).
_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}

_REMOVED_ROPE_MESSAGE = (
    "{flag} was removed; pass the RoPE settings through --hf-overrides with rope_parameters, e.g. "
    "--hf-overrides '{{\"rope_parameters\": {{\"rope_type\": \"yarn\", \"factor\": 4.0, "
    "\"original_max_position_embeddings\": 32768, \"rope_theta\": 1000000}}}}'"
)


def add_model_argument(parser: argparse.ArgumentParser) -> None:
    """MODEL, positional, or vLLM's `--model MODEL` (`vllm serve` still takes it); `resolve_model` merges them."""
    parser.add_argument("model", nargs="?", default=None,
                        help="model folder, hub id or .gguf file (default: the built-in default model)")
    parser.add_argument("--model", dest="model_flag", metavar="MODEL", default=None, action=StoreOnce,
                        help="the same as the positional MODEL (vLLM's flag form)")


def resolve_model(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Set `args.model` from `--model` when MODEL was not given; two different models are a usage error."""
    flag = getattr(args, "model_flag", None)
    if flag is None:
        return
    if args.model is not None and args.model != flag and not _same_folder(args.model, flag):
        parser.error(f"MODEL {args.model!r} and --model {flag!r} name two models: give one")
    args.model = args.model or flag


def _same_folder(a: str, b: str) -> bool:
    """Whether paths `a` and `b` name one existing file or folder (`m` and `m/`, a link to it)."""
    try:
        return os.path.samefile(a, b)
    except (OSError, ValueError):
        return False


def human_readable_int(value: str) -> int:
    """Parse "2048", "32k" (32000), "32K" (32768), "4G" (4 GiB) or "1.5M" into an int (vLLM's rule)."""
    text = value.strip().replace("_", "")
    scale = 1
    if text and text[-1] in _SUFFIXES:
        scale, text = _SUFFIXES[text[-1]], text[:-1]
    try:
        number = float(text) if "." in text else int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected an integer such as 2048, 32k or 4G, got {value!r}"
        ) from None
    result = number * scale
    if result != int(result):
        raise argparse.ArgumentTypeError(f"{value!r} is not a whole number")
    return int(result)


def parse_hf_overrides(value: str) -> dict[str, Any]:
    """Parse the JSON of --hf-overrides; the result must be a JSON object (a dict)."""
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(
            f"not valid JSON ({e.msg} at line {e.lineno} column {e.colno}): {value!r}; expected an "
            'object such as \'{"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}\''
        ) from None
    if not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError(
            f"expected a JSON object (a dict of config keys), got a JSON {type(parsed).__name__}: {value!r}"
        )
    return parsed


class StoreOnce(argparse.Action):
    """A flag that may be given once: a second value is an error, not silently the only one kept
    (`--hf-overrides` twice dropped the first dict; `--model a --model b` served b)."""

    def __call__(self, parser, namespace, values, option_string=None):
        if getattr(namespace, self.dest, None) is not None:
            hint = "put both values in one (a JSON object may set many keys)" if isinstance(values, dict) else "give one"
            parser.error(f"{option_string} was given twice; {hint}")
        setattr(namespace, self.dest, values)


def gpu_memory_utilization(value: str) -> float:
    """An argparse ``type``: a fraction in (0, 1]."""
    try:
        fraction = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {value!r}") from None
    if not 0.0 < fraction <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1], got {fraction}")
    return fraction


def _int_where(value: str, ok, expected: str) -> int:
    try:
        number = human_readable_int(value)
    except argparse.ArgumentTypeError:  # name what this flag takes, not the generic size examples
        raise argparse.ArgumentTypeError(f"expected {expected}, got {value!r}") from None
    if not ok(number):
        raise argparse.ArgumentTypeError(f"expected {expected}, got {value!r}")
    return number


def positive_int(value: str) -> int:
    """An argparse ``type``: human_readable_int (``4k``), at least 1 (argparse's exit status 2 otherwise)."""
    return _int_where(value, lambda n: n >= 1, "a positive integer")


def byte_size(value: str) -> int:
    """An argparse ``type`` for a size in bytes: human_readable_int (``4G``), at least 1."""
    return _int_where(value, lambda n: n >= 1, "a positive number of bytes (an integer, or one with "
                                               "a size suffix such as 512M or 4G)")


def non_negative_int(value: str) -> int:
    """An argparse ``type``: human_readable_int, at least 0."""
    return _int_where(value, lambda n: n >= 0, "an integer >= 0")


def max_logprobs_value(value: str) -> int:
    """An argparse ``type`` for --max-logprobs: a positive integer, or -1 (no limit but the vocabulary, as vLLM)."""
    return _int_where(value, lambda n: n >= 1 or n == -1, "a positive integer or -1 (no limit)")


def optimization_level(value: str) -> int:
    """vLLM's `-O` / `--compilation-config` value: an optimisation level 0-3 ("3", as in `-O 3` or `-O3`)."""
    text = value.strip()
    if not (text.isdigit() and int(text) in COMPILATION_LEVELS):
        raise argparse.ArgumentTypeError(
            f"expected an optimisation level 0, 1, 2 or 3 (vLLM's -O levels; a JSON compilation config is not "
            f"supported), got {value!r}")
    return int(text)


def add_compilation_argument(group) -> None:
    """`--compilation-config` / `-O` (one definition for the engine commands and `bench compare`)."""
    group.add_argument("--compilation-config", "-O", type=optimization_level, default=0, metavar="LEVEL",
                       help="optimisation level (vLLM's -O): 0 = no torch.compile, CUDA graphs only (default); "
                            "1-3 = also torch.compile the decoder layers (CUDA only; a CPU runs eager); each step then "
                            "runs the faster of the compiled and eager forwards, timed at load "
                            "(FXREWRITE_COMPILED_FORWARD=compiled|eager forces one)")


class _RemovedFlag(argparse.Action):
    """A RoPE flag vLLM once had and we do not: its value is kept (``args.removed_rope_flags``) so that
    `engine_kwargs` refuses the command with one suggestion covering every such flag given."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, "removed_rope_flags", nargs="?", default={}, help=argparse.SUPPRESS)

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, {**getattr(namespace, self.dest), option_string: values})


def removed_rope_flags_message(flags: dict[str, str | None], hf_overrides: dict[str, Any] | None = None) -> str:
    """The error for removed `flags` ({flag: value}): the one --hf-overrides JSON that sets all their values over
    `hf_overrides` (the command's own --hf-overrides, kept), or an example when a value cannot be read."""
    names = " and ".join(flags)
    params: dict[str, Any] = {}
    for flag, value in flags.items():
        read = _rope_params(flag, value)
        if read is None:
            return _REMOVED_ROPE_MESSAGE.format(flag=names)
        params |= read
    text = (f"{names} {'were' if len(flags) > 1 else 'was'} removed; pass the RoPE settings through --hf-overrides "
            f"with rope_parameters: --hf-overrides '{json.dumps(_with_rope_parameters(hf_overrides or {}, params))}'")
    if "--rope-scaling" in flags and "rope_type" not in params:
        text += " and a rope_type (--rope-scaling named none: linear, dynamic, yarn, llama3 or longrope)"
    return text


def _with_rope_parameters(overrides: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """`overrides` with `params` set in its rope_parameters (those it has kept where `params` does not set them)."""
    given = overrides.get("rope_parameters")
    return {**overrides, "rope_parameters": {**(given if isinstance(given, dict) else {}), **params}}


def _rope_params(flag: str, value: str | None) -> dict[str, Any] | None:
    """The rope_parameters a removed flag's value sets, or None when it cannot be read."""
    if value is None:
        return None
    try:
        if flag == "--rope-theta":
            return {"rope_theta": float(value)}
        params = json.loads(value)
    except ValueError:
        return None
    if not isinstance(params, dict):
        return None
    if "type" in params and "rope_type" not in params:  # legacy rope_scaling spelling
        params = {"rope_type": params.pop("type"), **params}
    return params


def _add_execution_arguments(g) -> None:
    """How the steps run: eager / CUDA graphs / torch.compile, async scheduling, batch-invariant kernels."""
    g.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs, no torch.compile")
    add_compilation_argument(g)
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                   help="schedule step n+1 while step n runs on the device")
    g.add_argument("--batch-invariant", action="store_true", default=False,
                   help="batch-invariant kernels: a sequence's logits (and so a seeded request's text) do not "
                        "depend on the rest of the batch or on prefix-cache hits, bf16 included; slower, no "
                        "torch.compile")


def _add_loading_arguments(g) -> None:
    """Where the weights and modeling code come from."""
    g.add_argument("--revision", default=None,
                   help="branch, tag or commit of a hub id MODEL (default: the latest)")
    g.add_argument("--download-dir", default=None,
                   help="folder of the Hugging Face hub cache a hub id MODEL is read from and downloaded into "
                        "(default: the HF cache, HF_HUB_CACHE); a local folder ignores it")
    g.add_argument("--load-format", default="auto", choices=("auto", "safetensors", "dummy"), help="weight format "
                   "(dummy: random weights, for benchmarks)")
    g.add_argument("--trust-remote-code", action="store_true", help="build a folder's own modeling code (auto_map)")


def add_engine_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the engine flags (vLLM names and defaults) to `parser`; returns it."""
    g = parser.add_argument_group("engine")
    g.add_argument("--runner", choices=("auto", "generate", "pooling"), default="auto",
                   help="pooling: serve embeddings of the model's last-token hidden state (POST /v1/embeddings) "
                        "instead of generating; auto = generate")
    g.add_argument("--task", choices=("auto", "generate", "embed"), default=None,
                   help="older vLLM spelling: --task embed is --runner pooling")
    g.add_argument("--model-impl", choices=("auto", "native", "transformers"), default="auto",
                   help="native: hand-written model in runtime/models; transformers: the HF modeling "
                        "code rewritten by fxrewrite; auto: native when one exists (default)")
    g.add_argument("--fusion", action=argparse.BooleanOptionalAction, default=True,
                   help="rewrite transformers models into fused layers (--no-fusion runs them as written)")
    g.add_argument("--tokenizer", default=None, help="tokenizer folder or hub id (default: the model's)")
    g.add_argument("--hf-overrides", type=parse_hf_overrides, default=None, action=StoreOnce,
                   help="JSON object merged into the model's config, e.g. "
                        '\'{"rope_parameters": {"rope_type": "yarn", "factor": 4.0, ...}}\'')
    g.add_argument("--max-model-len", type=positive_int, default=None,
                   help="context length in tokens (prompt + output); accepts 32k / 32K (default: from config)")
    g.add_argument("--dtype", default="auto",
                   choices=("auto", "half", "float16", "bfloat16", "float", "float32"),
                   help="weight and activation dtype (auto: the config's dtype, float32 when it names none)")
    g.add_argument("--seed", type=int, default=0, help="random seed of the engine")
    g.add_argument("--max-num-seqs", type=positive_int, default=256,
                   help="most sequences in one engine step")
    g.add_argument("--max-num-batched-tokens", type=positive_int, default=None,
                   help="most tokens in one engine step (default: derived from max-model-len)")
    g.add_argument("--block-size", type=positive_int, default=16, help="tokens per KV-cache block")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse KV blocks of shared prompt prefixes")
    g.add_argument("--gpu-memory-utilization", type=gpu_memory_utilization, default=0.9,
                   help="fraction of GPU memory the engine may use (weights + activations + KV cache)")
    g.add_argument("--kv-cache-memory-bytes", type=byte_size, default=None,
                   help="KV-cache size in bytes (e.g. 4G); overrides --gpu-memory-utilization for the cache")
    _add_execution_arguments(g)
    g.add_argument("--tensor-parallel-size", "-tp", type=positive_int, default=1,
                   help="number of GPUs to split the model over")
    g.add_argument("--data-parallel-size", "-dp", type=positive_int, default=1,
                   help="engine replicas (each tensor-parallel-size GPUs), one API server balancing requests by load")
    g.add_argument("--enable-expert-parallel", action="store_true", default=False,
                   help="MoE models: split whole experts across the tensor-parallel ranks (not each expert's "
                        "columns); with --data-parallel-size, across every replica's ranks (DP attention + EP)")
    g.add_argument("--pipeline-parallel-size", "-pp", type=positive_int, default=1,
                   help="pipeline stages (the decoder layers split between them); x tensor-parallel-size processes")
    g.add_argument("--quantization", "-q", choices=("fp8",), default=None,
                   help="fp8: quantize the linear layers of a bf16 checkpoint to FP8 at load (FP8 checkpoints "
                        "are detected from config.json)")
    g.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                   help="KV-cache element type: auto (the model's dtype) or fp8 (= fp8_e4m3) / fp8_e5m2, half the "
                        "bytes per cached token (scale 1.0, as vLLM without checkpoint KV scales)")
    g.add_argument("--generation-config", default="auto",
                   help="'auto': default sampling values from the model's generation_config.json; "
                        "'vllm': none; or a folder holding a generation_config.json")
    g.add_argument("--max-logprobs", type=max_logprobs_value, default=20,
                   help="most logprobs / prompt_logprobs a request may ask for (default 20; -1: the vocabulary)")
    _add_loading_arguments(g)
    _add_vllm_flags_without_settings(g)
    return parser


# vLLM flags with nothing to set in this engine: passed to LLM() only when given, where `VLLM_COMPAT_KWARGS` accepts
# the values that match it and names the accepted ones for any other (so a vLLM command line runs unchanged).
VLLM_COMPAT_FLAGS = ("enable_sleep_mode", "disable_log_stats", "enable_chunked_prefill", "swap_space",
                     "tokenizer_mode", "distributed_executor_backend", "logprobs_mode")


def _add_vllm_flags_without_settings(group) -> None:
    """`VLLM_COMPAT_FLAGS`, and vLLM's old rope flags (`_add_removed_flags`)."""
    group.add_argument("--enable-sleep-mode", action="store_true", default=None,
                       help="accepted: LLM.sleep() / wake_up() work without it")
    group.add_argument("--disable-log-stats", action="store_true", default=None,
                       help="accepted: the engine logs no periodic stats")
    group.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None,
                       help="accepted when on: prefill is always chunked (--max-num-batched-tokens per step)")
    group.add_argument("--swap-space", type=float, default=None,
                       help="accepted (GiB): there is no CPU swap; a preempted sequence is recomputed")
    group.add_argument("--tokenizer-mode", default=None, help="auto or hf: transformers' AutoTokenizer")
    group.add_argument("--distributed-executor-backend", default=None,
                       help="uni, mp or external_launcher, as the parallel sizes imply (default: picked by them)")
    group.add_argument("--logprobs-mode", default=None, help="raw_logprobs: log-softmax of the raw logits")
    _add_removed_flags(group)


def _add_removed_flags(group) -> None:
    """``--rope-scaling`` / ``--rope-theta``: an error pointing at --hf-overrides (`_RemovedFlag`)."""
    for flag in ("--rope-scaling", "--rope-theta"):
        group.add_argument(flag, action=_RemovedFlag)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The `LLM(...)` / `LLMEngine(...)` keyword arguments of parsed engine flags, `model` included.

    `model` is `args.model` (None selects the default model). `--generation-config` is not an
    engine argument: the server and the terminal commands read it (see `generation_defaults`).
    UserInputError for vLLM's removed --rope-scaling / --rope-theta, with the --hf-overrides to use instead.
    """
    if getattr(args, "removed_rope_flags", None):
        raise UserInputError(removed_rope_flags_message(args.removed_rope_flags, getattr(args, "hf_overrides", None)))
    kwargs = {name: getattr(args, name) for name in ENGINE_KWARG_NAMES}
    kwargs |= {name: getattr(args, name) for name in VLLM_COMPAT_FLAGS if getattr(args, name, None) is not None}
    kwargs["model"] = getattr(args, "model", None)
    task = getattr(args, "task", None)
    kwargs["runner"] = "pooling" if task == "embed" else "generate" if task == "generate" else getattr(args, "runner", "auto")
    return kwargs
