"""The engine's settings: one dataclass, vLLM's argument names; LLM(**kwargs) is checked against it."""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, fields
from numbers import Real
from typing import Any

from fxrewrite.errors import UserInputError, UserTypeError

SEED_RANGE = (-(2**63), 2**63 - 1)
"""The seeds torch.manual_seed and torch.Generator.manual_seed take: the engine's and a request's."""


MODEL_IMPLS = ("auto", "native", "transformers")
DTYPES = ("auto", "float32", "float16", "bfloat16", "half", "float")  # vLLM's --dtype choices
LOAD_FORMATS = ("auto", "safetensors", "dummy")
QUANTIZATIONS = ("fp8",)
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
"""vLLM's `--kv-cache-dtype` names: "auto" is the model's dtype; "fp8" is "fp8_e4m3" (runtime/worker/kv_cache.py)."""
RUNNERS = ("auto", "generate", "pooling")
COMPILATION_LEVELS = (0, 1, 2, 3)
"""vLLM's optimisation levels (`-O`, `compilation_config`); see `EngineConfig.compilation_config`."""

logger = logging.getLogger(__name__)


DEFAULT_BLOCK_SIZE = 16


@dataclass
class EngineConfig:
    """Everything `LLM(...)` accepts. Units: tokens, blocks of `block_size` tokens, bytes."""

    model: str | None = None
    """Local folder, hub id or .gguf file; None means the built-in default model."""
    tokenizer: str | None = None
    model_impl: str = "auto"
    """"native" (runtime/models), "transformers" (HF modeling code), "auto" (native when available)."""
    fusion: bool = True
    """With model_impl transformers: rewrite the model with fxrewrite.optimize (False = unfused)."""
    hf_overrides: dict[str, Any] | str | Callable[[Any], Any] | None = None
    """Config overrides: a dict, its JSON text, or a callable(config) -> config (see runtime/hf_config.py)."""
    max_model_len: int | None = None
    dtype: str = "auto"
    seed: int | None = 0
    """None: 0, as vLLM's engine (its V1 cannot run unseeded)."""
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    """Token budget of one step (chunked prefill); None means max(8192, max_num_seqs)."""
    block_size: int | None = DEFAULT_BLOCK_SIZE  # tokens per KV block; None: the default
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.9
    """Fraction of GPU memory the engine may use (weights + activations + KV cache), in (0, 1]."""
    kv_cache_memory_bytes: int | None = None
    """KV cache size in bytes on any device; overrides gpu_memory_utilization."""
    enforce_eager: bool = False
    compilation_config: int = 0
    """vLLM's optimisation level: 0 = no torch.compile (CUDA graphs stay on unless enforce_eager);
    1-3 = torch.compile the decoder layers on CUDA, one graph for all of them
    (fxrewrite.runtime.worker.compilation). Off by default until it is measured to win (BENCHMARKS.md)."""
    async_scheduling: bool = True
    """Schedule and launch step n+1 while step n runs (its tokens feed n+1 on the device). Applies to
    the single-process engine; the tensor-parallel executor steps synchronously."""
    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False
    """MoE models: whole experts split across the tensor-parallel ranks instead of each expert's columns."""
    batch_invariant: bool = False
    """Run every step with batch-invariant kernels (`fxrewrite.kernels.batch_invariant`): a sequence's
    logits, hence its sampled tokens' logprobs, do not depend on what else is in the batch, and equal a
    trainer's `fxrewrite.rl.completion_logprobs` inside `batch_invariant_mode()`. No torch.compile. Slower."""
    data_parallel_size: int = 1
    """Engine replicas, each tensor_parallel_size workers with its own KV cache, behind one front that
    balances requests by load (runtime/engine/data_parallel.py). With enable_expert_parallel, MoE
    experts are split over all data_parallel_size x tensor_parallel_size workers (DP attention + EP)."""
    pipeline_parallel_size: int = 1
    """Pipeline stages, each holding a contiguous share of the decoder layers (runtime/worker/pipeline.py);
    tensor_parallel_size x pipeline_parallel_size worker processes."""
    quantization: str | None = None
    """"fp8": quantize a bf16/fp16/fp32 checkpoint's linear layers to FP8 (128 x 128 blocks) at load.
    FP8 checkpoints (quantization_config in config.json) need nothing (runtime/model_files/quantization.py)."""
    kv_cache_dtype: str = "auto"
    """The paged KV cache's element type: "auto" (the model's dtype) or FP8 ("fp8" = "fp8_e4m3", "fp8_e5m2"),
    half the bytes of bf16 per cached token, so twice the tokens fit (decode attention reads half the bytes but,
    on the H200, is not faster yet: README "FP8 KV cache").
    Keys and values are stored with scale 1.0 (clamped to the format's range), as vLLM does for a
    checkpoint without KV scales; the attention kernels widen them to the query's dtype."""
    load_format: str = "auto"
    """"auto"/"safetensors" load the checkpoint; "dummy" keeps random weights (benchmarks)."""
    revision: str | None = None
    download_dir: str | None = None
    """vLLM's: the Hugging Face hub cache folder a hub id `model` (or `tokenizer`) is read from and downloaded
    into, instead of the default one (HF_HUB_CACHE); a local folder ignores it."""
    trust_remote_code: bool = False
    device: str | None = None
    """torch device; None picks cuda when available, else cpu."""
    max_logprobs: int = 20
    """Most logprobs / prompt_logprobs a request may ask for (vLLM's default, 20); -1: no limit but the
    vocabulary size (vLLM's -1)."""
    runner: str = "auto"
    """"generate" (auto) samples tokens; "pooling" returns embeddings (`LLM.embed`, /v1/embeddings): the
    last token's final hidden state, L2-normalised (runtime/engine/pooling.py). Single process only."""

    def __post_init__(self) -> None:
        _check_choice("model_impl", self.model_impl, MODEL_IMPLS)
        if not isinstance(self.dtype, str) and type(self.dtype).__module__ != "torch":  # a torch.dtype
            raise UserTypeError(f"dtype={self.dtype!r} must be a string or a torch.dtype, one of {DTYPES}")
        _check_choice("dtype", str(self.dtype).removeprefix("torch."), DTYPES)
        _check_choice("load_format", self.load_format, LOAD_FORMATS)
        _check_choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        _check_choice("runner", self.runner, RUNNERS)
        check_compilation_config(self.compilation_config)
        if self.block_size is None:  # vLLM's None: the default
            self.block_size = DEFAULT_BLOCK_SIZE
        positive = {
            "max_num_seqs": self.max_num_seqs,
            "block_size": self.block_size,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "max_model_len": self.max_model_len,
            "kv_cache_memory_bytes": self.kv_cache_memory_bytes,
        }
        for name, value in positive.items():  # a bool is an int to Python, not to a user: True is no count
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise UserInputError(f"{name}={value!r} must be a positive integer")
        logprobs = self.max_logprobs  # -1: no limit but the vocabulary (vLLM's)
        if not isinstance(logprobs, int) or isinstance(logprobs, bool) or (logprobs < 1 and logprobs != -1):
            raise UserInputError(f"max_logprobs={logprobs!r} must be a positive integer or -1 (no limit)")
        self.seed = check_seed(self.seed)
        for name in ("fusion", "enable_prefix_caching", "enforce_eager", "async_scheduling", "trust_remote_code",
                     "enable_expert_parallel", "batch_invariant"):
            if not isinstance(getattr(self, name), bool):
                raise UserInputError(f"{name}={getattr(self, name)!r} must be True or False")
        if not isinstance(self.gpu_memory_utilization, (int, float)) or isinstance(self.gpu_memory_utilization, bool) \
                or not 0 < self.gpu_memory_utilization <= 1:
            raise UserInputError(f"gpu_memory_utilization={self.gpu_memory_utilization!r} must be in (0, 1]")
        if not isinstance(self.tensor_parallel_size, int) or isinstance(self.tensor_parallel_size, bool) or self.tensor_parallel_size < 1:
            raise UserInputError(f"tensor_parallel_size={self.tensor_parallel_size!r} must be a positive integer")
        if not isinstance(self.data_parallel_size, int) or isinstance(self.data_parallel_size, bool) or self.data_parallel_size < 1:
            raise UserInputError(f"data_parallel_size={self.data_parallel_size!r} must be a positive integer")
        if not isinstance(self.pipeline_parallel_size, int) or isinstance(self.pipeline_parallel_size, bool) or self.pipeline_parallel_size < 1:
            raise UserInputError(f"pipeline_parallel_size={self.pipeline_parallel_size!r} must be a positive integer")
        check_device(self.device, self.tensor_parallel_size * self.pipeline_parallel_size * self.data_parallel_size)
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise UserInputError(f"quantization={self.quantization!r} is not supported; supported: {list(QUANTIZATIONS)}")
        if self.hf_overrides is not None and not (
            isinstance(self.hf_overrides, (dict, str)) or callable(self.hf_overrides)
        ):  # the JSON text and the dict itself are checked when the config loads
            raise UserTypeError(
                "hf_overrides must be a dict, a JSON object string or a callable(config) -> config, "
                f"got {type(self.hf_overrides).__name__}: {self.hf_overrides!r}"
            )
        self.download_dir = check_download_dir(self.download_dir)
        if self.runner == "pooling" and max(self.tensor_parallel_size, self.pipeline_parallel_size,
                                            getattr(self, "data_parallel_size", 1)) > 1:
            raise UserInputError("runner='pooling' runs in one process: tensor_parallel_size, "
                                 "pipeline_parallel_size and data_parallel_size must be 1")
        if self.batch_invariant and self.tensor_parallel_size > 1:
            logger.warning("batch_invariant=True with tensor_parallel_size=%d: the kernels are batch-invariant, the "
                           "all-reduce between ranks is not (its reduction order follows the message size, i.e. the "
                           "batch), so outputs may still depend on the batch; use tensor_parallel_size=1 for "
                           "bitwise-repeatable results", self.tensor_parallel_size)
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = max(8192, self.max_num_seqs)

    @property
    def is_pooling(self) -> bool:
        return self.runner == "pooling"

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Build from LLM(...) keyword arguments: the fields, plus the vLLM arguments of `VLLM_COMPAT_KWARGS`
        (checked, then dropped; `task` sets `runner`). TypeError naming any unknown one, ValueError naming a
        compat argument's value this engine does not honour and the values it does."""
        known = {f.name for f in fields(cls)} | set(VLLM_COMPAT_KWARGS)
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise UserTypeError(
                f"LLM() got unexpected keyword argument(s) {', '.join(map(repr, unknown))}; "
                f"accepted: {', '.join(sorted(known))}"
            )
        compat = {name: kwargs.pop(name) for name in list(kwargs) if name in VLLM_COMPAT_KWARGS}
        if "task" in compat:
            kwargs["runner"] = _task_runner(compat["task"], kwargs.get("runner", "auto"))
        config = cls(**kwargs)
        for name, value in compat.items():
            accepts, expected, note = VLLM_COMPAT_KWARGS[name]
            if not accepts(value, config):
                raise UserInputError(f"{name}={value!r} is not supported; expected {expected}")
            logger.debug("LLM(%s=%r) accepted for vLLM compatibility: %s", name, value, note)
        return config


def check_download_dir(value: Any) -> str | None:
    """`download_dir` as a string (a path-like object's text); UserTypeError naming it for anything but None, a
    non-empty string or a path. The folder need not exist: huggingface_hub creates it on download."""
    if value is None:
        return None
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str) or not value.strip():
        raise UserTypeError(f"download_dir={value!r} must be a folder path (a non-empty string) or None")
    return os.path.expanduser(value)


TASK_RUNNERS = {"auto": None, "generate": "generate", "embed": "pooling"}
"""vLLM's `task` -> this engine's `runner` (None: keep the given runner); `fxrewrite serve --task` maps the same."""


def _task_runner(task: Any, runner: str) -> str:
    """The runner `task` selects; UserInputError when it contradicts an explicit `runner` (an unknown task is left
    to the compat table's check, which names the accepted ones)."""
    wanted = TASK_RUNNERS.get(task) if isinstance(task, str) else None
    if wanted is None:
        return runner
    if runner not in ("auto", wanted):
        raise UserInputError(f"task={task!r} selects runner={wanted!r}, but runner={runner!r} was given; "
                             "pass one of them")
    return wanted


def _executor_backend_matches(backend: Any, config: EngineConfig) -> bool:
    """Whether the engine runs as vLLM's `distributed_executor_backend` would: None picks by size; "uni" is
    the model in this process (one rank); "mp" is worker processes (one rank runs in this process, same
    outputs); "external_launcher" is torchrun SPMD, every rank its own engine (`distributed.init_from_env`)."""
    ranks = config.tensor_parallel_size * config.pipeline_parallel_size * config.data_parallel_size
    if backend is None or backend == "mp":
        return True
    if backend == "uni" and ranks > 1:
        raise UserInputError(f"distributed_executor_backend='uni' runs one rank in this process, but the parallel "
                             f"sizes ask for {ranks} ranks; use 'mp' (worker processes) or leave it unset")
    if backend == "uni":
        return True
    if backend == "external_launcher" and ranks == config.tensor_parallel_size:
        from fxrewrite import distributed  # here: this module stays free of torch for the CLI's argument checks

        state = distributed.get_state()
        return ranks == 1 or (state is not None and state.tp_group is not None and state.tp_size == ranks)
    return False


def _is_bool(value: Any, config: EngineConfig) -> bool:
    return isinstance(value, bool)


# vLLM LLM(...) arguments with nothing to set here, accepted with the values that describe what this engine
# does (code written for vLLM passes them): name -> (accepts(value, config), expected values, why it is a no-op).
VLLM_COMPAT_KWARGS: dict[str, tuple[Callable[[Any, EngineConfig], bool], str, str]] = {
    "enable_sleep_mode": (_is_bool, "True or False", "LLM.sleep() / wake_up() work without it"),
    "disable_log_stats": (_is_bool, "True or False", "the engine logs no periodic stats"),
    "enable_chunked_prefill": (
        lambda v, c: v is None or v is True,
        "True or None: the engine always splits long prompts into chunks of at most max_num_batched_tokens "
        "per step and has no unchunked prefill",
        "prefill is always chunked"),
    "swap_space": (
        lambda v, c: isinstance(v, Real) and not isinstance(v, bool) and 0 <= v < math.inf,
        "a finite non-negative number (GiB of CPU swap space)",
        "no CPU swap space: a preempted sequence is recomputed"),
    "tokenizer_mode": (
        lambda v, c: v in ("auto", "hf"),
        "'auto' or 'hf' (the Hugging Face tokenizer, fast when the model has one); 'slow', 'mistral' and "
        "'custom' are not supported",
        "the tokenizer is transformers' AutoTokenizer"),
    "task": (
        lambda v, c: isinstance(v, str) and v in TASK_RUNNERS,
        "'auto', 'generate' or 'embed' (runner='pooling')", "mapped to runner"),
    "distributed_executor_backend": (
        _executor_backend_matches,
        "None, 'uni' (one rank, in this process), 'mp' (worker processes) or 'external_launcher' (torchrun: "
        "tensor_parallel_size ranks after fxrewrite.distributed.init_from_env, or 1)",
        "the engine picks its executor from the parallel sizes"),
    "logprobs_mode": (
        lambda v, c: v == "raw_logprobs",
        "'raw_logprobs': logprobs are the log-softmax of the model's raw logits, before temperature, "
        "penalties and top-k / top-p",
        "the engine's logprobs are raw_logprobs"),
}


def check_seed(seed: Any) -> int:
    """The engine's seed: an integer in SEED_RANGE, or None for 0 (vLLM's LLM(seed=None): its engine cannot run
    unseeded either). UserTypeError / UserInputError naming the value."""
    if seed is None:
        return 0
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise UserTypeError(f"seed={seed!r} must be an integer")
    if not SEED_RANGE[0] <= seed <= SEED_RANGE[1]:
        raise UserInputError(f"seed={seed} must be in [{SEED_RANGE[0]}, {SEED_RANGE[1]}]")
    return seed


def check_device(device: Any, ranks: int = 1) -> None:
    """UserInputError unless `device` is None or a torch device this process can use: "cpu", "cuda" / "cuda:N"
    with CUDA available and N below the device count (torch's own errors for these are a bare AssertionError
    or a RuntimeError deep in the model load). With `ranks` > 1 (TP x PP x DP) CUDA's presence is left to the
    executors' check, whose error names the sizes and the GPUs they need."""
    if device is None:
        return
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise UserInputError(f"device={device!r} is not a torch device ({e}); expected e.g. 'cpu', 'cuda', "
                             "'cuda:1'") from None
    if dev.type not in ("cpu", "cuda"):
        raise UserInputError(f"device={device!r}: the engine runs on 'cpu' or 'cuda', not {dev.type!r}")
    if dev.type == "cuda" and ranks == 1:
        if not torch.cuda.is_available():
            raise UserInputError(f"device={device!r}: this torch sees no CUDA device (torch {torch.__version__}); "
                                 "use device='cpu' or leave it unset")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise UserInputError(f"device={device!r}: only {torch.cuda.device_count()} CUDA device(s) visible")


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise UserInputError(f"{name}={value!r} is not one of {', '.join(map(repr, choices))}")


def check_compilation_config(level: Any) -> int:
    """`level` when it is one of `COMPILATION_LEVELS` (an int: vLLM's `-O` level; a JSON compilation config
    is not supported); UserInputError naming the value otherwise."""
    if not isinstance(level, int) or isinstance(level, bool) or level not in COMPILATION_LEVELS:
        raise UserInputError(f"compilation_config={level!r}: expected an optimisation level 0, 1, 2 or 3 "
                             "(vLLM's -O levels; 0: no torch.compile, 1-3: compile the decoder layers)")
    return level
