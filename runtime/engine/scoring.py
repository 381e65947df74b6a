"""Scores of text pairs from an embedding (pooling) model: vLLM's Score API for an embedding model, where the score
of a pair is the cosine similarity of the two texts' embeddings (docs.vllm.ai, "Score API": "for embedding models
the score is the cosine similarity"; vLLM's bi-encoder path, `_cosine_similarity` / `BiEncoderIOProcessor`).

Pairing follows vLLM's `_validate_score_input_lens`: one text against one (1:1), one against each of N (1:N, the
single first text broadcast), or N against N pairwise; any other pair of counts, or an empty side, is refused.
What `LLM.score` and the server's /score and /rerank share lives here; both embed each distinct text once.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

import torch

from fxrewrite.errors import UserInputError


@dataclass
class ScoringOutput:
    """One pair's score (vLLM's `ScoringOutput`): the cosine similarity of the two embeddings, in [-1, 1]."""

    score: float


@dataclass
class ScoringRequestOutput:
    """What `LLM.score` returns per pair (vLLM's `ScoringRequestOutput`). As in vLLM: `request_id` is the two
    embedding requests' ids joined by "_", and `prompt_token_ids` the first text's ids, the tokenizer's pad token
    (when it has one) and the second text's ids."""

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True


def check_pair_counts(len_1: int, len_2: int, name_1: str = "data_1", name_2: str = "data_2") -> None:
    """UserInputError (naming both sides and their counts) unless the counts pair as 1:1, 1:N or N:N."""
    if len_1 == 0:
        raise UserInputError(f"{name_1} is empty: at least one text element must be given")
    if len_2 == 0:
        raise UserInputError(f"{name_2} is empty: at least one text_pair element must be given")
    if len_1 > 1 and len_1 != len_2:
        raise UserInputError(f"{name_1} has {len_1} items and {name_2} has {len_2}: input lengths must be either "
                             f"1:1, 1:N or N:N (one {name_1} scored against each {name_2}, or pairwise)")


def pair_indices(len_1: int, len_2: int) -> list[tuple[int, int]]:
    """(i, j) per pair, in output order: (0, j) for each j when len_1 is 1, else (i, i); counts as checked by
    `check_pair_counts`."""
    return [(0 if len_1 == 1 else j, j) for j in range(len_2)]


def dedupe(items: Sequence) -> tuple[list, list[int]]:
    """(the distinct items, in first-seen order; the index among them of each item). Texts are compared as
    strings, token-id prompts (lists of ints) as tuples; anything else (a prompt dict, a malformed prompt, which
    the engine then refuses) is kept as its own item."""
    distinct, slots, where = [], {}, []
    for n, item in enumerate(items):
        key = ("text", item) if isinstance(item, str) else ("item", n)
        if isinstance(item, (list, tuple)) and all(type(t) is int for t in item):
            key = ("ids", tuple(item))
        if key not in slots:
            slots[key] = len(distinct)
            distinct.append(item)
        where.append(slots[key])
    return distinct, where


def cosine_score(embedding_1: Sequence[float], embedding_2: Sequence[float]) -> float:
    """The cosine similarity of two embeddings (float32, `torch.nn.functional.cosine_similarity`, eps 1e-8, as
    vLLM's `CosineSimilarity(0)`), as a Python float."""
    a = torch.as_tensor(embedding_1, dtype=torch.float32)
    b = torch.as_tensor(embedding_2, dtype=torch.float32)
    return float(torch.nn.functional.cosine_similarity(a, b, dim=0))


def pair_token_ids(ids_1: Sequence[int], ids_2: Sequence[int], pad_token_id: int | None) -> list[int]:
    """A pair's `prompt_token_ids` as vLLM reports them: ids_1, the pad token when the tokenizer has one, ids_2
    (what vLLM's score usage counts)."""
    return [*ids_1, *([] if pad_token_id is None else [pad_token_id]), *ids_2]


def score_outputs(embedded: Sequence, slots_1: Sequence[int], slots_2: Sequence[int],
                  pad_token_id: int | None) -> list[ScoringRequestOutput]:
    """One ScoringRequestOutput per pair, in `pair_indices` order, from the distinct prompts' embedding outputs
    (`embedded`, EmbeddingRequestOutputs) and each side's index into them (`slots_1`, `slots_2`)."""
    outputs = []
    for i, j in pair_indices(len(slots_1), len(slots_2)):
        first, second = embedded[slots_1[i]], embedded[slots_2[j]]
        score = cosine_score(first.outputs.embedding, second.outputs.embedding)
        outputs.append(ScoringRequestOutput(f"{first.request_id}_{second.request_id}", ScoringOutput(score),
                                            pair_token_ids(first.prompt_token_ids, second.prompt_token_ids,
                                                           pad_token_id)))
    return outputs


def renamed_prompt_error(error: Exception, names: Sequence[str]) -> Exception:
    """`error` ("prompt 3: ...", as LLM.embed names a prompt by its index) naming it `names[3]` instead (which
    side and item of a score call it came from); "prompts=5 must be ..." (a side that is no prompt or list at all)
    naming the side, `data_1=5 must be ...`; other errors as they are."""
    whole = re.match(r"prompts(=.*)", str(error), re.S)
    if whole is not None and names:
        return type(error)(f"{names[0].split('[')[0]}{whole.group(1)}")
    found = re.match(r"prompt (\d+)(:.*)", str(error), re.S)
    if found is None or int(found.group(1)) >= len(names):
        return error
    return type(error)(f"{names[int(found.group(1))]}{found.group(2)}")
