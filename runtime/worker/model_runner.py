"""Build and load the model, allocate the KV cache, run one step and sample."""

from __future__ import annotations

import logging
from contextlib import contextmanager

import torch
from torch import nn

from fxrewrite import distributed
from fxrewrite.kernels import gemv_dispatch, greedy_sample, paged_decode, pdl
from fxrewrite.kernels.batch_invariant import batch_invariant_mode
from fxrewrite.layers.rope_context import rope_lengths
from fxrewrite.layers.fused_moe import prepare_moe_router
from fxrewrite.layers.rotary import cover_positions
from fxrewrite.layers.skinny import prepare_skinny_gemv
from fxrewrite.runtime.model_files.quantization import (
    check_fp8_checkpoint_tensors,
    check_fp8_tensor_parallel,
    fill_dummy_weights,
    finish_fp8_model,
    prepare_fp8_model,
    resolve_quantization,
)
from fxrewrite.runtime.worker.pipeline import PipelineStage, pipeline_stage_of_this_rank
from fxrewrite.runtime.worker.compilation import (compile_model, compiled_forward_mode, compiled_model_forwards,
                                                  forwards_of, should_compile)
from fxrewrite.runtime.worker.cuda_graphs import build_graph_runner
from fxrewrite.runtime.engine_config import EngineConfig
from fxrewrite.runtime.worker.forward_context import forward_context
from fxrewrite.runtime.engine.block_table_cache import BlockTableCache
from fxrewrite.runtime.engine.inputs import prepare_inputs
from fxrewrite.runtime.engine.prompt_logprobs import compute_prompt_logprobs, wants_prompt_logprobs
from fxrewrite.runtime.worker.kv_cache import allocate_kv_caches, kv_cache_dtype, num_kv_blocks
from fxrewrite.runtime.worker.memory_profiling import profile_num_kv_blocks
from fxrewrite.runtime.worker.load_check import check_first_step, check_position_table
from fxrewrite.runtime.worker.warmup import faster_step_forward, should_warm_up, warm_up_kernels
from fxrewrite.runtime.worker import greedy_head, sleep_mode, watchdog, weight_sync
from fxrewrite.runtime.engine.sampler import SampledTokens, SampleResult, Sampler
from fxrewrite.runtime.engine.scheduler import SchedulerOutput
from fxrewrite.runtime.engine.sequence import Sequence
from fxrewrite.runtime.model_files.config import ModelConfig
from fxrewrite.runtime.model_files.config_checks import check_weights_fit, config_json_values
from fxrewrite.runtime.model_files.default_model import default_model_path
from fxrewrite.runtime.model_files.loader import load_weights, materialize
from fxrewrite.errors import UserInputError
from fxrewrite.runtime.models.registry import get_native_model_cls, resolve_model_impl as resolve_impl
from fxrewrite.runtime.models.transformers_backend import TransformersForCausalLM
from fxrewrite.sharding import shard_model

logger = logging.getLogger(__name__)


def load_model_config(config: EngineConfig):
    """ModelConfig for config.model (None: the built-in default model)."""
    model = config.model
    if model is None:
        model = str(default_model_path())
    model_config = ModelConfig.from_pretrained(
        model, hf_overrides=config.hf_overrides, max_model_len=config.max_model_len, dtype=config.dtype,
        tokenizer=config.tokenizer, revision=config.revision, trust_remote_code=config.trust_remote_code,
        download_dir=config.download_dir,
    )
    quant = resolve_quantization(config.quantization, model_config.hf_config)  # unsupported methods fail here
    resolve_model_impl(config, model_config)  # model_impl='native' without a native class fails here
    if config.load_format != "dummy":  # before any worker starts, not as a weight loader's shape error
        text_config = model_config.hf_text_config
        original = config_json_values(model_config.model_path, text_config is not model_config.hf_config)
        check_weights_fit(text_config, original, model_config.model_path)
        check_fp8_checkpoint_tensors(quant, model_config.model_path)
    # dummy weights of an FP8 checkpoint's config take its block layout too (fill_dummy_weights)
    check_fp8_tensor_parallel(quant, model_config.hf_text_config, config.tensor_parallel_size)
    return model_config


def load_tokenizer(model_config, config: EngineConfig):
    """The model's tokenizer. Its `model_max_length` is lifted: the engine checks every prompt against
    max_model_len itself (with a clear error), so transformers' own "Token indices sequence length is
    longer than the specified maximum" warning would only be noise (or wrong, under RoPE scaling).

    UserInputError naming the tokenizer's folder or id when transformers cannot load it (a corrupt
    tokenizer.json: its JSON error) or when what it loads has no vocabulary: for a folder without tokenizer files
    transformers builds an empty tokenizer of the config's class, which encodes every text to no tokens."""
    from transformers import AutoTokenizer
    from transformers.tokenization_utils_base import VERY_LARGE_INTEGER

    source = str(model_config.tokenizer)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=config.trust_remote_code)
    except Exception as e:  # noqa: BLE001 - a JSONDecodeError, a KeyError or the tokenizers library's bare Exception
        reason = " ".join(str(e).split())[:400]  # one line (transformers' messages list candidates line by line)
        raise UserInputError(f"tokenizer {source!r} cannot be loaded: {type(e).__name__}: {reason}") from e
    if not tokenizer("a", add_special_tokens=False)["input_ids"]:
        raise UserInputError(
            f"tokenizer {source!r} has no vocabulary ({len(tokenizer)} token(s); no tokenizer.json, tokenizer.model or "
            "vocabulary files there?): pass a folder or hub id that has one as tokenizer= (--tokenizer)")
    if len(tokenizer) + _VOCAB_PADDING < (getattr(model_config, "vocab_size", None) or 0):  # past a padded LM head
        logger.warning("tokenizer %r has %d tokens, the model %d: sampled ids past the tokenizer's decode to no text "
                       "(is it this model's tokenizer?)", source, len(tokenizer), model_config.vocab_size)
    tokenizer.model_max_length = VERY_LARGE_INTEGER
    return tokenizer


_VOCAB_PADDING = 1024  # LM-head rows a checkpoint may pad past its tokenizer (Qwen3: 267, DeepSeek-V3: 465)


def resolve_model_impl(config: EngineConfig, model_config) -> str:
    """"native" or "transformers" for config.model_impl (`registry.resolve_model_impl`)."""
    return resolve_impl(config.model_impl, model_config)


def build_model(config: EngineConfig, model_config, device: torch.device, stage: PipelineStage | None = None) -> nn.Module:
    """The model on `device` with its weights (random ones with load_format='dummy'); with a pipeline
    `stage`, only that stage's decoder layers."""
    impl = resolve_model_impl(config, model_config)
    distributed.set_expert_parallel(config.enable_expert_parallel and config.tensor_parallel_size > 1)
    if impl == "native":
        cls = get_native_model_cls(model_config.architectures)
        with _default_dtype(model_config.dtype):
            model = cls(model_config, device="meta")
    else:
        model = TransformersForCausalLM.from_config(model_config.hf_config, model_config.dtype, config.fusion,
                                                    config.trust_remote_code)
        _shard_for_tensor_parallel(model)
    if stage is not None:
        model.pp_dropped_prefixes = stage.apply(model, model_config.num_hidden_layers)
    quant = resolve_quantization(config.quantization, model_config.hf_config)
    prepare_fp8_model(model, quant)
    model = materialize(model, device)
    if config.load_format == "dummy":
        fill_dummy_weights(model)
    else:
        load_weights(model, model_config.model_path, native=impl == "native",
                     fp8_block=quant.weight_block_size if quant and quant.is_checkpoint_fp8 else None,
                     pooling=config.is_pooling)
    finish_fp8_model(model, quant, model_config.dtype, device)
    model.impl = impl
    return model.eval()


def _shard_for_tensor_parallel(model: nn.Module) -> None:
    """On a TP rank: shard the (optimized) HF model as its fusion says (fxrewrite.sharding); no-op at TP 1."""
    shard_model(model.hf_model, distributed.get_tp_rank(), distributed.get_tp_size())


@contextmanager
def _default_dtype(dtype: torch.dtype):
    """Parameters created inside take `dtype` (restored afterwards, also on errors)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def check_kernel_switches(device: torch.device) -> None:
    """The FXREWRITE_* switches the kernels read at each launch (FXREWRITE_GEMV, FXREWRITE_PDL and its prefetch
    size, FXREWRITE_KV_FP8_DOTS, FXREWRITE_DECODE_TILE), FXREWRITE_GRAPH_LOGITS, FXREWRITE_GREEDY_KERNEL and
    FXREWRITE_COMPILED_FORWARD, checked before anything is built, on any device: UserInputError naming a bad value,
    or ``on`` on a device without PDL."""
    try:
        gemv_dispatch.mode()
        compiled_forward_mode()
        pdl.check_environment(device)
        paged_decode.default_fp8_dots()
        paged_decode.decode_tile()
        greedy_head.enabled()
        greedy_sample.kernel_enabled()
    except (ValueError, RuntimeError) as e:
        raise UserInputError(str(e)) from None


class ModelRunner:
    """Owns the model, the KV caches and the sampler; `execute_model` runs one scheduled step."""

    def __init__(self, config: EngineConfig, model_config, eos_token_ids: set[int]):
        self.config = config
        self.model_config = model_config
        self.sleep_state: sleep_mode.SleepState | None = None
        self.device = torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        check_kernel_switches(self.device)
        self.block_size = config.block_size
        self.table_cache = BlockTableCache()  # block tables between steps: only appended blocks are written
        torch.manual_seed(config.seed)
        self.pipeline = pipeline_stage_of_this_rank()
        watchdog.phase("building the model")
        self.model = build_model(config, model_config, self.device, self.pipeline)
        cover_positions(self.model, model_config.max_model_len)  # rope caches read directly, up to max_model_len
        check_position_table(self.model, model_config.max_model_len)
        if self.pipeline is not None:
            self.pipeline.allocate(max(config.max_num_batched_tokens, config.max_num_seqs), model_config.hidden_size,
                                   model_config.dtype, self.device)
        self.kv_dtype = kv_cache_dtype(config.kv_cache_dtype, model_config.dtype)
        if self.pipeline is None:  # a stage's forward needs its peers' hidden states
            watchdog.phase("a dummy step through the model")
            check_first_step(self.model, config, model_config, self.device, self.kv_dtype)
        compiled = should_compile(config, self.device)
        # skinny GEMV vs cuBLAS per layer shape, before any graph is captured: for the eager forward, which a
        # compiled model's decode graphs may hold too (the faster of the two; compiled code never takes the GEMV)
        if self.device.type == "cuda" and (not compiled or "eager" in compiled_model_forwards()):
            watchdog.phase("timing the skinny GEMV against cuBLAS")
            prepare_skinny_gemv(self.model, self.device, model_config.dtype, config.max_num_seqs)
            watchdog.phase("timing the MoE router launch shapes")
            prepare_moe_router(self.model, self.device, model_config.dtype)
        if compiled:
            compile_model(self.model)
        layers = self.pipeline.layers if self.pipeline is not None else None  # a stage caches its layers only
        watchdog.phase("sizing and allocating the KV cache")
        if self.device.type == "cuda" and config.kv_cache_memory_bytes is None:
            self.num_blocks = profile_num_kv_blocks(self.model, config, model_config, self.device, self.kv_dtype,
                                                    layers)
        else:
            self.num_blocks = num_kv_blocks(config, model_config, self.device, self.kv_dtype, layers)
        self.kv_caches = allocate_kv_caches(model_config, self.num_blocks, self.block_size, self.kv_dtype,
                                            self.device, layers)
        if self.device.type == "cuda":  # small TP all-reduces over NVLink peer memory (no-op at TP=1)
            distributed.enable_symm_mem_all_reduce(self.device, model_config.dtype)
        self.step_forward, self.step_forward_seconds = "model", {}
        """The forward the steps outside CUDA graphs run ("model": not compiled; "compiled" or "eager": the faster of
        a compiled model's two at load, `warmup.faster_step_forward`) and the times it was chosen on."""
        with batch_invariant_mode(config.batch_invariant):  # the graphs capture the invariant kernels
            if getattr(self.model, "_fxrewrite_compiled", False) and self.device.type == "cuda":
                self.step_forward, self.step_forward_seconds = faster_step_forward(
                    self.model, self.kv_caches, config, model_config, self.device)
                times = ", ".join(f"{kind} {s * 1e3:.1f} ms" for kind, s in self.step_forward_seconds.items())
                logger.info("steps outside CUDA graphs run the %s forward of the compiled model (%s)",
                            self.step_forward, times or "one candidate: FXREWRITE_COMPILED_FORWARD or parallelism")
            # Triton's JIT at load, not in the first requests (a pipeline stage's forward needs its peers)
            if should_warm_up(self.device, self.pipeline):
                with forwards_of(self.step_forward):
                    self.warmup_compiles = warm_up_kernels(self.model, self.kv_caches, config, model_config,
                                                           self.device)
            self.graph_runner = build_graph_runner(self.model, self.kv_caches, config, model_config, self.device)
        self.sampler = Sampler(eos_token_ids, seed=config.seed)

    # RL: in-place weight updates and sleep mode (runtime/worker/weight_sync.py, sleep_mode.py)
    def load_weights(self, weights: list[tuple[str, torch.Tensor]], strict: bool = True) -> set[str]:
        """Check every tensor, then copy them into the model in place; see `weight_sync.update_weights`."""
        plan = self.plan_weights([(name, tuple(t.shape)) for name, t in weights], strict)
        return self.apply_weights(plan, [t for _, t in weights], strict)

    def plan_weights(self, metas: list[tuple[str, tuple[int, ...]]], strict: bool) -> list:
        """`weight_sync.plan_update` (ValueError for bad input); RuntimeError while the weights are asleep."""
        state = self.sleep_state
        if state is not None and "weights" in state.asleep:
            raise RuntimeError("load_weights: the weights are asleep; call wake_up() (or wake_up(['weights'])) first")
        return weight_sync.plan_update(self.model, metas, strict)

    def apply_weights(self, plan: list, tensors: list[torch.Tensor], strict: bool) -> set[str]:
        weight_sync.apply_update(plan, tensors)
        state = self.sleep_state
        if state is not None and state.weights_discarded:  # level 2's garbage is gone once every parameter is written
            weight_sync.coverage(plan, into=state.written)  # in one call, or over several with strict=False
            if strict or not weight_sync.uncovered(self.model, state.written):
                state.weights_discarded, state.written = False, {}
        if state is not None and not state.asleep and not state.weights_discarded:
            self.sleep_state = None
        return {t.name for t in plan if t is not None}

    def sleep(self, level: int = 1) -> None:
        state = self.sleep_state
        asleep = state if state is not None and state.asleep else None
        sleep_mode.check_level(level, asleep)  # asleep already at this level or deeper: nothing to do
        if state is None:
            self.sleep_state = sleep_mode.sleep(self, level)
        elif asleep is None:  # awake after a level-2 sleep, its weights not reloaded: nothing to keep, free both
            self.sleep_state = sleep_mode.sleep(self, 2)

    def wake_up(self, tags: list[str] | None = None) -> None:
        state = self.sleep_state
        if state is not None:
            sleep_mode.wake_up(self, state, tags)
            if not state.asleep and not state.weights_discarded:
                self.sleep_state = None

    def sleep_status(self) -> tuple[tuple[str, ...], bool] | None:
        """None when awake, else (parts still asleep, whether the weights await load_weights)."""
        state = self.sleep_state
        return None if state is None else (tuple(state.asleep), state.weights_discarded)

    supports_async = True
    """`execute_model_async` can take the previous step's tokens from the device (LLMEngine checks this)."""

    def execute_model(self, sched: SchedulerOutput, bitmask_hook=None) -> tuple[list[Sequence], list[SampleResult]]:
        """Run the step's flattened tokens; returns the sequences that sampled and their samples."""
        return self.execute_model_async(sched, None, bitmask_hook).result()

    @torch.inference_mode()
    def execute_model_async(self, sched: SchedulerOutput, previous: PendingStep | None = None,
                            bitmask_hook=None) -> PendingStep:
        """Launch the step and return without waiting for the device. Tokens of `previous` (the step still
        in flight) that this step feeds back are read from its sampled tokens on the device.

        bitmask_hook: None, or a callable(sampling sequences) -> the sampler's `bitmask` argument, called
        after the forward pass and the logits are launched (structured outputs: the host fills the grammar
        masks while the device runs the model); when it returns a callable instead, that callable gives the
        mask later and the step samples then: when its tokens are first needed (the next step's launch, or
        `result()`), so the host does not wait for the mask in this call."""
        with batch_invariant_mode(self.config.batch_invariant):
            return self._execute(sched, previous, bitmask_hook)

    def _execute(self, sched: SchedulerOutput, previous: PendingStep | None, bitmask_hook) -> PendingStep:
        rows = previous.rows if previous is not None else None
        inputs = prepare_inputs(sched.scheduled, self.block_size, self.device, rows, self.table_cache)
        inputs.attn_metadata.kv_caches = self.kv_caches
        num_tokens, head, graphs = inputs.input_ids.shape[0], None, self.graph_runner
        use_graph = graphs is not None and graphs.can_run(num_tokens, inputs.attn_metadata)
        input_ids = inputs.input_ids
        if inputs.gather_dst is not None:
            if use_graph and inputs.gather_in_order:  # the graph copies them in: no gather launches
                input_ids = previous.samples.tokens[:num_tokens]
            else:
                inputs.input_ids[inputs.gather_dst] = previous.samples.tokens[inputs.gather_src]
        if self.pipeline is not None:
            self.pipeline.receive(num_tokens)
        with forward_context(inputs.attn_metadata), rope_lengths(inputs.rope_lengths):
            if use_graph:
                hidden = graphs.run(input_ids, inputs.positions, inputs.attn_metadata, inputs.rope_lengths,
                                    inputs.per_token)
                head = graphs.head(num_tokens)
            else:
                with forwards_of(self.step_forward):
                    hidden = self.model(inputs.input_ids, inputs.positions)
        if self.pipeline is not None and not self.pipeline.is_last:
            self.pipeline.send(hidden[:num_tokens])
            return PendingStep(sched, None)
        prompt_logprobs = None
        if any(wants_prompt_logprobs(s) for s in sched.scheduled):
            prompt_logprobs = compute_prompt_logprobs(self.model.compute_logits, hidden, sched.scheduled)
        seqs = inputs.sample_seqs
        if not seqs:
            return PendingStep(sched, None, prompt_logprobs)
        if head is not None and len(seqs) != num_tokens:  # a row that does not sample (a one-token prefill chunk)
            head = None
        last_hidden = hidden[inputs.logits_indices] if head is None else hidden
        logits = self.model.compute_logits(last_hidden) if head is None else head.logits
        bitmask = bitmask_hook(seqs) if bitmask_hook is not None else None
        if head is not None and bitmask is None and self.sampler.is_plain_greedy(seqs):
            step = PendingStep(sched, SampledTokens(seqs, head.tokens, head.packed), prompt_logprobs)
        elif callable(bitmask):  # a mask still being filled: sample when the tokens are first needed
            logits = logits if head is None else logits.clone()  # the graph's logits: overwritten by the next replay
            later = (seqs, lambda: self._sample_later(logits, seqs, bitmask))
            step = PendingStep(sched, None, prompt_logprobs, later)
        else:
            step = PendingStep(sched, self.sampler.sample(logits, seqs, bitmask), prompt_logprobs)
        if self.config.is_pooling:  # embeddings: the last-token final hidden states [S, H] (engine/pooling.py)
            step.pooled = last_hidden.float()
        return step

    @torch.inference_mode()
    def _sample_later(self, logits: torch.Tensor, seqs: list[Sequence], bitmask) -> SampledTokens:
        """A deferred sampler launch (from `PendingStep.samples`, maybe outside `execute_model_async`)."""
        with batch_invariant_mode(self.config.batch_invariant):
            return self.sampler.sample(logits, seqs, bitmask())


class PendingStep:
    """A launched step: its schedule and its sampled tokens (on the device until `result()`)."""

    def __init__(self, sched: SchedulerOutput, samples: SampledTokens | None, prompt_logprobs=None,
                 sample_later: tuple | None = None):
        self.sched = sched
        self._samples = samples
        self._sample_later = sample_later
        """None, or (sampling sequences, callable() -> SampledTokens) run at the first use of `samples`."""
        self.prompt_logprobs = prompt_logprobs
        """list[PromptLogprobsChunk] of this step, or None."""
        self.pooled: torch.Tensor | None = None
        """Pooling runner: final hidden states [S, H] float32 of the sampling rows, on the device."""
        self.seqs: list[Sequence] = sample_later[0] if sample_later else samples.seqs if samples is not None else []
        self.rows = {seq.seq_id: i for i, seq in enumerate(self.seqs)}
        """seq_id -> row of its sample in `samples.tokens`."""

    @property
    def samples(self) -> SampledTokens | None:
        """The sampled tokens (on the device); a deferred sampler launch happens here, once."""
        if self._sample_later is not None:
            self._samples = self._sample_later[1]()
            self._sample_later = None
        return self._samples

    def token_ids(self) -> tuple[list[Sequence], list[int]]:
        """(sequences that sampled, their token ids): `result()` without building SampleResults."""
        samples = self.samples
        return (self.seqs, samples.token_ids()) if samples is not None else ([], [])

    def result(self) -> tuple[list[Sequence], list[SampleResult]]:
        """(sequences that sampled, their SampleResults); waits for this step's tokens only."""
        if self.samples is None:
            return [], []
        return self.seqs, self.samples.results()
