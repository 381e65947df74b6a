"""Embeddings from a causal LM run as a pooling model (vLLM's `--runner pooling`, older `--task embed`).

vLLM's default pooler for an embedding task on a decoder-only model is LAST pooling with L2
normalisation (docs.vllm.ai, "Pooling Models"): the embedding of a prompt is the final hidden state
(after the model's last norm, i.e. what the LM head would read) at its last token, divided by its
Euclidean norm. Here a pooling request is a one-step prefill through the usual scheduler (chunked
prefill and prefix caching apply); the model runner hands back that row, in float32, instead of only
a sampled token.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from fxrewrite.errors import UserInputError, UserTypeError
from fxrewrite.runtime.engine.sampling_params import SamplingParams


@dataclass
class PoolingParams:
    """Per-request pooling settings (vLLM's `PoolingParams`, embed task).

    normalize: divide the last-token hidden state by its L2 norm (vLLM's default for embed).
    dimensions: a shorter (Matryoshka) embedding, the first `dimensions` values normalised after the cut (vLLM's);
    None: all hidden_size. Checked against the model when the request is added (`check_dimensions`).
    truncate_prompt_tokens: embed only the prompt's last k tokens (-1: max_model_len of them; None: all), as
    SamplingParams' field (checked against max_model_len when the request is added).
    """

    normalize: bool = True
    dimensions: int | None = None
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.normalize, bool):
            raise UserInputError(f"PoolingParams: normalize={self.normalize!r} must be True or False")
        keep = self.truncate_prompt_tokens
        if keep is not None and (not isinstance(keep, int) or isinstance(keep, bool)):
            raise UserTypeError(f"PoolingParams: truncate_prompt_tokens={keep!r} must be an integer or None")
        if keep is not None and keep < 1 and keep != -1:
            raise UserInputError(f"PoolingParams: truncate_prompt_tokens={keep} must be -1 (max_model_len tokens) "
                                 "or at least 1")
        if self.dimensions is not None and (not isinstance(self.dimensions, int) or isinstance(self.dimensions, bool)):
            raise UserTypeError(f"PoolingParams: dimensions={self.dimensions!r} must be an integer or None")


@dataclass
class EmbeddingOutput:
    """One prompt's embedding: hidden_size floats (vLLM's `EmbeddingOutput`)."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """What `LLM.embed` returns per prompt (vLLM's `EmbeddingRequestOutput`); `outputs` is None until
    the request finished."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput | None
    finished: bool


def check_dimensions(dimensions: int | None, hf_config, hidden_size: int) -> None:
    """vLLM's Matryoshka rule for `dimensions` (PoolingParams.verify): None always passes; otherwise the config
    must say `is_matryoshka: true` or list `matryoshka_dimensions` (set them with hf_overrides, as in vLLM), a listed
    size must be one of the list, and any size must be in [1, hidden_size]. UserInputError naming the value."""
    if dimensions is None:
        return
    allowed = getattr(hf_config, "matryoshka_dimensions", None)
    if not allowed and not getattr(hf_config, "is_matryoshka", False):
        raise UserInputError(f"dimensions={dimensions} is not supported: this model does not support matryoshka "
                             "representation (its config has no is_matryoshka / matryoshka_dimensions; hf_overrides "
                             "sets them); changing output dimensions would give poor results: leave dimensions unset")
    if allowed and dimensions not in allowed:
        raise UserInputError(f"dimensions={dimensions} is not supported: this model only supports "
                             f"{list(allowed)} matryoshka dimensions")
    if not 1 <= dimensions <= hidden_size:
        raise UserInputError(f"dimensions={dimensions} must be in [1, {hidden_size}] (the hidden size)")


def check_sentence_transformers_pooling(model_path: Path) -> None:
    """Refuse a Sentence Transformers folder whose modules.json asks for what LAST pooling does not do: a Pooling
    module whose config (e.g. 1_Pooling/config.json) sets a mode other than `pooling_mode_lasttoken` (vLLM reads it
    and pools MEAN / CLS instead), or a Dense projection. Without modules.json, or with LAST pooling (as
    Qwen3-Embedding's), nothing is checked. UserInputError naming the file and the mode."""
    modules_json = Path(model_path) / "modules.json"
    try:
        modules = json.loads(modules_json.read_text())
    except (OSError, ValueError):
        return
    for module in modules if isinstance(modules, list) else []:
        kind = str(module.get("type", "")) if isinstance(module, dict) else ""
        if kind.endswith("Dense"):
            raise UserInputError(f"{modules_json} has a Dense module ({module.get('path')}): its projection is not "
                                 "applied here, so the embeddings would differ from the model's; unsupported")
        if not kind.endswith("Pooling"):
            continue
        pooling_json = Path(model_path) / str(module.get("path", "")) / "config.json"
        try:
            modes = json.loads(pooling_json.read_text())
        except (OSError, ValueError):
            continue
        wanted = [key for key, value in modes.items() if key.startswith("pooling_mode_") and value is True]
        if wanted and wanted != ["pooling_mode_lasttoken"]:
            raise UserInputError(f"{pooling_json} sets {', '.join(wanted)}: this engine pools the last token only "
                                 "(pooling_mode_lasttoken, vLLM's LAST), so the embeddings would differ from the "
                                 "model's; unsupported")


def last_token_embedding(hidden: torch.Tensor, normalize: bool, dimensions: int | None = None) -> list[float]:
    """The embedding of one prompt from its last-token final hidden state `hidden` [H] (any float dtype,
    any device): its first `dimensions` values (None: all; Matryoshka), float32, then L2-normalised when
    `normalize` (torch.nn.functional.normalize, eps 1e-12), in vLLM's order."""
    vector = hidden.float()[:dimensions]
    if normalize:
        vector = torch.nn.functional.normalize(vector, dim=-1)
    return vector.tolist()


def split_params(params, is_pooling: bool, model_config=None):
    """(PoolingParams or None, the SamplingParams the engine runs) for a request's params on a runner.
    A pooling request is a one-token greedy step (its token is dropped). ValueError for params that do
    not fit the runner (vLLM refuses generation on a pooling model and the reverse), or (given the engine's
    ModelConfig) dimensions the model does not take (`check_dimensions`)."""
    if params is not None and not isinstance(params, (SamplingParams, PoolingParams)):
        raise UserTypeError(f"sampling_params={params!r:.80}: expected a SamplingParams (or PoolingParams), got "
                            f"{type(params).__name__}")
    if not is_pooling:
        if isinstance(params, PoolingParams):
            raise UserInputError("PoolingParams need an engine made with runner='pooling' (embeddings); this "
                                 "one generates: pass SamplingParams, or start it with runner='pooling'")
        return None, params or SamplingParams()
    if params is not None and not isinstance(params, PoolingParams):
        raise UserInputError(f"this engine runs runner='pooling': it returns embeddings (LLM.embed, /v1/embeddings) "
                             f"and does not generate; got {type(params).__name__}, expected PoolingParams")
    pooling = params or PoolingParams()
    if model_config is not None:
        check_dimensions(pooling.dimensions, model_config.hf_config, model_config.hidden_size)
    return pooling, SamplingParams(max_tokens=1, temperature=0.0, truncate_prompt_tokens=pooling.truncate_prompt_tokens)


def pooling_output(request, embeddings: dict[int, torch.Tensor], requests: dict) -> EmbeddingRequestOutput:
    """The EmbeddingRequestOutput of an engine request (its one sequence's row popped from `embeddings`,
    seq_id -> last-token final hidden state [H] on the host, once it finished; a finished request is
    also dropped from the engine's `requests`)."""
    seq = request.seqs[0]
    finished = request.finished
    if finished:
        del requests[request.request_id]
    row = embeddings.pop(seq.seq_id, None) if finished else None
    params = request.pooling_params
    outputs = None if row is None else EmbeddingOutput(last_token_embedding(row, params.normalize, params.dimensions))
    return EmbeddingRequestOutput(request.request_id, request.prompt, request.prompt_token_ids, outputs, finished)


def pooled_rows(step, seqs: list) -> dict[int, torch.Tensor]:
    """{seq_id: last-token final hidden state [H] on the host} of a pooling step's live sequences (those
    not aborted while it ran; each is finished and its output made in the same engine step), else {}."""
    pooled = getattr(step, "pooled", None)
    if pooled is None:
        return {}
    return {seq.seq_id: row for seq, row in zip(seqs, pooled.cpu()) if not seq.is_finished}
