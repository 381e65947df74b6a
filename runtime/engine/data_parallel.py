"""Data parallelism: `data_parallel_size` engine replicas behind one front (vLLM's ``--data-parallel-size``).

`make_engine(config)` is what `LLM` and `fxrewrite serve` call: an `LLMEngine` at data_parallel_size 1,
else a `DPLLMEngine`. The front owns one `LLMEngine` per replica (its own scheduler, block manager and
KV cache; each replica may itself be tensor parallel) and one `DPExecutor` that runs every replica's
workers. A new request goes to the least loaded replica, scored as vLLM's load-balancing client scores
its engines: 4 x waiting + running sequences (ties: the lower replica index). `step()` steps every
replica, then sends their steps to the workers as one wave, so the replicas run together (and, with
``enable_expert_parallel``, meet in every MoE layer: `fxrewrite.layers.moe_dp`).
"""

from __future__ import annotations

from typing import Any, Iterable

from fxrewrite.errors import UserInputError
from fxrewrite.runtime.engine.llm_engine import LLMEngine
from fxrewrite.runtime.engine.outputs import RequestOutput
from fxrewrite.runtime.engine.request_extras import eos_token_ids
from fxrewrite.runtime.engine.sampling_params import SamplingParams
from fxrewrite.runtime.engine.vllm_accessors import VLLMEngineAccessors
from fxrewrite.runtime.engine_config import EngineConfig
from fxrewrite.runtime.worker.dp_checks import check_data_parallel
from fxrewrite.runtime.worker.dp_executor import DPExecutor
from fxrewrite.runtime.worker.model_runner import load_model_config, load_tokenizer


def make_engine(config: EngineConfig) -> LLMEngine | DPLLMEngine:
    """The engine for `config`: `DPLLMEngine` when data_parallel_size > 1, else `LLMEngine`."""
    return DPLLMEngine(config) if config.data_parallel_size > 1 else LLMEngine(config)


class DPLLMEngine(VLLMEngineAccessors):
    """`LLMEngine`'s interface over data_parallel_size replicas (see the module docstring).

    Raises UserInputError before any worker starts for settings that cannot run (`check_data_parallel`).
    Weight sync and sleep mode raise NotImplementedError.
    """

    def __init__(self, config: EngineConfig):
        self.config = config
        self.model_config = load_model_config(config)
        check_data_parallel(config, self.model_config)
        self.tokenizer = load_tokenizer(self.model_config, config)
        self.eos_token_ids = eos_token_ids(self.tokenizer, self.model_config)
        self.executor = DPExecutor(config, self.model_config, self.eos_token_ids)
        self.engines = [LLMEngine(config, model_config=self.model_config, tokenizer=self.tokenizer,
                                  model_runner=self.executor.replica(d)) for d in range(config.data_parallel_size)]
        self._owner: dict[str, int] = {}
        """request_id -> replica index, until the request's final output is returned."""
        self.num_requests_routed = [0] * config.data_parallel_size
        """Requests each replica has been given since start."""

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> DPLLMEngine:
        return cls(EngineConfig.from_kwargs(**kwargs))

    @property
    def model_runner(self):
        """Replica 0's runner view (`model.impl` and the like; the weights live in the workers)."""
        return self.engines[0].model_runner

    @property
    def max_seq_len(self) -> int:
        """`LLMEngine.max_seq_len` of the replica that holds the least."""
        return min(e.max_seq_len for e in self.engines)

    @property
    def scheduler(self):
        """Replica 0's scheduler (the settings, as `max_num_seqs`, are every replica's)."""
        return self.engines[0].scheduler

    def replica_loads(self) -> list[int]:
        """Per replica: 4 x waiting + running sequences (what `add_request` balances)."""
        return [4 * len(e.scheduler.waiting) + len(e.scheduler.running) for e in self.engines]

    def add_request(self, request_id: str, prompt: str | list[int], sampling_params: SamplingParams | None = None,
                    *, final_only: bool = False):
        """Queue the request on the least loaded replica; ValueError as `LLMEngine.add_request`."""
        if request_id in self._owner:
            raise UserInputError(f"request_id {request_id!r} is already in use")
        loads = self.replica_loads()
        d = loads.index(min(loads))
        self.engines[d].add_request(request_id, prompt, sampling_params, final_only=final_only)
        self._owner[request_id] = d
        self.num_requests_routed[d] += 1

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        for rid in [request_id] if isinstance(request_id, str) else request_id:
            d = self._owner.pop(rid, None)
            if d is not None:
                self.engines[d].abort_request(rid)

    def compile_structured_outputs(self, params: SamplingParams):
        return self.engines[0].compile_structured_outputs(params)

    def has_unfinished_requests(self) -> bool:
        return any(e.has_unfinished_requests() for e in self.engines)

    def get_num_unfinished_requests(self) -> int:
        return sum(e.get_num_unfinished_requests() for e in self.engines)

    def step(self) -> list[RequestOutput]:
        """One step of every replica with work, launched together; their RequestOutputs."""
        outputs: list[RequestOutput] = []
        try:
            for engine in self.engines:
                if engine.has_unfinished_requests() or engine._inflight is not None:
                    outputs += engine.step()
            self.executor.flush()
        except BaseException:
            for engine in self.engines:
                engine._abort_all()
            self._owner.clear()
            raise
        for out in outputs:
            if out.finished:
                self._owner.pop(out.request_id, None)
        return outputs

    def take_failed_requests(self) -> dict[str, str]:
        """`LLMEngine.take_failed_requests` over the replicas."""
        failed = {rid: why for engine in self.engines for rid, why in engine.take_failed_requests().items()}
        for rid in failed:
            self._owner.pop(rid, None)
        return failed

    def check_health(self) -> None:
        self.executor.check_health()

    def get_stats(self) -> dict:
        """`LLMEngine.get_stats` summed over the replicas (kv_cache_usage: held / total blocks), plus
        "data_parallel": each replica's own stats."""
        per = [e.get_stats() for e in self.engines]
        total = {k: sum(s[k] for s in per) for k in per[0] if k != "kv_cache_usage"}
        total["kv_cache_usage"] = 1.0 - total["num_free_blocks"] / max(1, total["num_blocks"])
        total["data_parallel"] = per
        return total

    def reset_prefix_cache(self) -> None:
        for engine in self.engines:
            engine.reset_prefix_cache()

    def is_sleeping(self) -> bool:
        return False

    def _unsupported(self, *args, **kwargs):
        raise NotImplementedError("load_weights / sleep / wake_up are not supported with data_parallel_size > 1")

    load_weights = sleep = wake_up = _unsupported

    def shutdown(self) -> None:
        self.executor.shutdown()
