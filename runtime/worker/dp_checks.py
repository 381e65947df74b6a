"""Data-parallel settings checked before any worker starts (clear errors naming the values)."""

from __future__ import annotations

import torch

from fxrewrite import distributed
from fxrewrite.errors import UserInputError
from fxrewrite.runtime.worker.cpu_threads import usable_cpus
from fxrewrite.runtime.worker.executor import check_tp_divisible
from fxrewrite.runtime.worker.moe_checks import check_moe_parallel


MAX_CPU_WORKERS_PER_CPU = 4
"""CPU (gloo) workers allowed per usable CPU: each holds its part of the model and runs the collectives of every
step; beyond a few per CPU a replica set only thrashes (DP=64 x TP=2 on 2 CPUs ran out of memory while starting)."""


def check_gpu_count(config) -> None:
    """UserInputError when data_parallel_size x tensor_parallel_size x pipeline_parallel_size workers
    need more GPUs than are visible, or (CPU workers, which share the host) more than MAX_CPU_WORKERS_PER_CPU
    per usable CPU."""
    dp, tp, pp = config.data_parallel_size, config.tensor_parallel_size, config.pipeline_parallel_size
    sizes = f"data_parallel_size={dp} x tensor_parallel_size={tp} x pipeline_parallel_size={pp}"
    if distributed.default_backend(config.device) != "nccl":
        cpus = usable_cpus()
        if dp * tp * pp > MAX_CPU_WORKERS_PER_CPU * cpus:
            raise UserInputError(f"{sizes} starts {dp * tp * pp} CPU worker processes on {cpus} usable CPUs; at "
                                 f"most {MAX_CPU_WORKERS_PER_CPU * cpus} ({MAX_CPU_WORKERS_PER_CPU} per CPU) are "
                                 "allowed, each holding its part of the model")
        return
    found = torch.cuda.device_count()
    if dp * tp * pp > found:
        raise UserInputError(f"{sizes} needs {dp * tp * pp} GPUs, found {found}")


def check_data_parallel(config, model_config) -> None:
    """Everything a data_parallel_size > 1 engine needs, checked on the driver: UserInputError for
    pipeline parallelism (not combined with DP), GPUs too few, a TP size the model does not divide,
    and MoE settings (`check_moe_parallel`: top-k, experts over dp x tp ranks with expert parallelism).
    Whether the model's MoE layers can share experts across replicas (fused ones, or transformers' experts
    modules, fusion on or off) is known once it is built: the workers check it
    (`dp_worker.check_model_shares_experts`)."""
    if config.pipeline_parallel_size > 1:
        raise UserInputError(f"data_parallel_size={config.data_parallel_size} with pipeline_parallel_size="
                             f"{config.pipeline_parallel_size} is not supported; use one of them")
    check_gpu_count(config)
    check_moe_parallel(model_config, config)
    if config.tensor_parallel_size > 1:
        check_tp_divisible(model_config, config.tensor_parallel_size, config)
