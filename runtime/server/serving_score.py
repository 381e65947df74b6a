"""vLLM's Score and Rerank APIs for a server started with `--runner pooling`: a pair's score is the cosine
similarity of the two texts' embeddings (the /v1/embeddings ones), as vLLM scores with an embedding model.

POST /score (and /v1/score), vLLM's ScoreRequest: one pair of fields, `text_1` / `text_2` (vLLM's first names),
`data_1` / `data_2`, `queries` / `documents` or `queries` / `items` (its later ones), each a string or a list of
strings, paired 1:1, 1:N (the one first text against each second one) or N:N (pairwise); `truncate_prompt_tokens`
and `add_special_tokens` as /v1/embeddings. Response: {"id", "object": "list", "created", "model", "data":
[{"index", "object": "score", "score"}] (one per pair, in the second side's order), "usage": {"prompt_tokens",
"total_tokens"}}.

POST /rerank (and /v1/rerank, /v2/rerank; Jina's and Cohere's shape, as vLLM serves it): `query` a string,
`documents` a list of strings (or one), `top_n` (0, absent or negative: all, as vLLM), `return_documents` (default
true, Jina's default and vLLM's only behaviour: each result carries {"text"}; false leaves `document` out).
Response: {"id", "model", "usage": {"prompt_tokens", "total_tokens"}, "results": [{"index", "document",
"relevance_score"}]}, sorted by relevance_score, highest first (ties in document order).

Usage counts, as vLLM does, each pair's first text, the tokenizer's pad token (when it has one) and its second text;
each distinct text is embedded once per request. Every text is tokenized (in the tokenizer thread) and checked
(empty, longer than max_model_len) before any is queued: a 400 naming it (`documents[2]`). A generating server
answers 400 saying to start it with `--runner pooling`.
"""

from __future__ import annotations

import time
from http import HTTPStatus
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field, StrictBool

from fxrewrite.errors import UserInputError
from fxrewrite.runtime.engine.pooling import PoolingParams
from fxrewrite.runtime.engine.scoring import check_pair_counts, cosine_score, dedupe, pair_indices, pair_token_ids
from fxrewrite.runtime.server.errors import OpenAIError
from fxrewrite.runtime.server.protocol import OpenAIBaseModel, RequestInt, RequestModel
from fxrewrite.runtime.server.protocol_responses import UsageInfo
from fxrewrite.runtime.server.serving_embedding import OpenAIServingEmbedding

_SCORE_PAIRS = (("text_1", "text_2"), ("data_1", "data_2"), ("queries", "documents"), ("queries", "items"))
"""vLLM's ScoreRequest variants: the field pairs a score request may name its two sides by."""

_Texts = str | list[str] | None


class ScoreRequest(RequestModel):
    model: str | None = None
    text_1: _Texts = None
    text_2: _Texts = None
    data_1: _Texts = None
    data_2: _Texts = None
    queries: _Texts = None
    documents: _Texts = None
    items: _Texts = None
    truncate_prompt_tokens: RequestInt | None = Field(None, ge=-1)  # vLLM's: keep each text's last k tokens
    add_special_tokens: StrictBool | None = None  # as /v1/embeddings' input (None: true)
    user: str | None = None


class RerankRequest(RequestModel):
    model: str | None = None
    query: str
    documents: str | list[str]
    top_n: RequestInt = 0  # vLLM's: 0 (or less) returns every document
    return_documents: StrictBool = True
    truncate_prompt_tokens: RequestInt | None = Field(None, ge=-1)
    add_special_tokens: StrictBool | None = None
    user: str | None = None


class ScoreResponseData(OpenAIBaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(OpenAIBaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[ScoreResponseData]
    usage: UsageInfo


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int
    document: RerankDocument | None = None
    relevance_score: float


class RerankUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class RerankResponse(OpenAIBaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


class OpenAIServingScores(OpenAIServingEmbedding):
    """/score and /rerank over the async engine of a pooling runner (tokenization and its 400s: the embedding
    endpoint's, `OpenAIServingEmbedding._encode` / `_checked`)."""

    async def create_score(self, request: ScoreRequest, raw_request: Request) -> ScoreResponse:
        model = self.model_name(request.model)
        self._check_pooling("Score")
        (name_1, side_1), (name_2, side_2) = _score_sides(request)
        request_id, engine_id = self.request_ids("score", raw_request, request)
        scored = await self._score(request, engine_id, (name_1, side_1), (name_2, side_2))
        tokens = sum(n for _, n in scored)
        return ScoreResponse(id=request_id, created=int(time.time()), model=model,
                             data=[ScoreResponseData(index=i, score=s) for i, (s, _) in enumerate(scored)],
                             usage=UsageInfo(prompt_tokens=tokens, total_tokens=tokens))

    async def do_rerank(self, request: RerankRequest, raw_request: Request) -> RerankResponse:
        model = self.model_name(request.model)
        self._check_pooling("Rerank")
        documents = [request.documents] if isinstance(request.documents, str) else request.documents
        request_id, engine_id = self.request_ids("rerank", raw_request, request)
        scored = await self._score(request, engine_id, ("query", request.query), ("documents", documents))
        results = [RerankResult(index=i, relevance_score=s,
                                document=RerankDocument(text=documents[i]) if request.return_documents else None)
                   for i, (s, _) in enumerate(scored)]
        results.sort(key=lambda r: -r.relevance_score)  # stable: ties keep the documents' order
        if request.top_n > 0:
            results = results[:request.top_n]
        tokens = sum(n for _, n in scored)
        return RerankResponse(id=request_id, model=model, results=results,
                              usage=RerankUsage(prompt_tokens=tokens, total_tokens=tokens))

    def _check_pooling(self, api: str) -> None:
        if not self.engine.engine.config.is_pooling:
            raise OpenAIError(HTTPStatus.BAD_REQUEST, f"The model does not support the {api} API: this server "
                              "generates; start it with `fxrewrite serve MODEL --runner pooling` to score texts by "
                              "their embeddings", param="model", code="model_not_supported")

    async def _score(self, request, engine_id: str, first: tuple[str, Any],
                     second: tuple[str, Any]) -> list[tuple[float, int]]:
        """(score, token count as vLLM's usage counts it) per pair of `first` and `second` ((field, a text or a
        list of texts) each), in `pair_indices` order; every distinct text embedded once."""
        sides = [(name, [texts] if isinstance(texts, str) else texts, isinstance(texts, str))
                 for name, texts in (first, second)]
        try:
            check_pair_counts(len(sides[0][1]), len(sides[1][1]), sides[0][0], sides[1][0])
        except UserInputError as e:
            empty = [name for name, texts, _ in sides if not texts]
            raise OpenAIError(HTTPStatus.BAD_REQUEST, str(e), param=(empty or [sides[1][0]])[0],
                              code="invalid_value") from None
        ids_1, ids_2 = await self.async_tokenizer.run(self._side_ids, request, sides)
        distinct, slots = dedupe(ids_1 + ids_2)
        vectors = await self._embed_all(engine_id, distinct, sides[0][0])
        slots_1, slots_2 = slots[:len(ids_1)], slots[len(ids_1):]
        pad = getattr(self.tokenizer, "pad_token_id", None)
        return [(cosine_score(vectors[slots_1[i]], vectors[slots_2[j]]),
                 len(pair_token_ids(ids_1[i], ids_2[j], pad))) for i, j in pair_indices(len(ids_1), len(ids_2))]

    def _side_ids(self, request, sides: list[tuple[str, list[str], bool]]) -> list[list[list[int]]]:
        """Each side's texts as token ids (run in the tokenizer thread), truncated and checked as /v1/embeddings
        checks an input; a 400 names the text (`text_2[1]`, or `query` for a bare string)."""
        return [[self._checked(request, self._encode(request, text, where), where)
                 for text, where in zip(texts, [name] if single else [f"{name}[{i}]" for i in range(len(texts))])]
                for name, texts, single in sides]

    async def _embed_all(self, engine_id: str, prompts: list[list[int]], prompt_field: str) -> list[tuple]:
        """The embedding of each prompt (L2-normalised floats), from one engine request each."""
        params = PoolingParams()
        ids, streams = await self.start_requests(engine_id, [(p, params) for p in prompts], prompt_field=prompt_field)
        try:
            vectors = []
            for stream in streams:
                last = None
                async for output in stream:
                    last = output
                vectors.append(last.embedding)
        finally:
            self.abort_all(ids)
        return vectors


def _score_sides(request: ScoreRequest) -> tuple[tuple[str, Any], tuple[str, Any]]:
    """((field, value), (field, value)) of the one field pair a score request gives; a 400 naming the field at
    fault when it gives none, half of one, or more than one."""
    given = [name for name in ("text_1", "text_2", "data_1", "data_2", "queries", "documents", "items")
             if getattr(request, name) is not None]
    pairs = [pair for pair in _SCORE_PAIRS if set(pair) <= set(given)]
    if len(pairs) == 1 and set(given) == set(pairs[0]):
        return tuple((name, getattr(request, name)) for name in pairs[0])
    extra = [name for name in given if not pairs or name not in pairs[0]]
    missing = [b if a in given else a for a, b in _SCORE_PAIRS if a in given or b in given]
    param = extra[0] if pairs else (missing or ["text_1"])[0]
    got = ", ".join(given) if given else "none of them"
    raise OpenAIError(HTTPStatus.BAD_REQUEST, "give one pair of texts to score: text_1 and text_2, data_1 and data_2, "
                      f"queries and documents, or queries and items (got {got})", param=param, code="invalid_value")


def add_score_routes(app: FastAPI, scores: OpenAIServingScores) -> None:
    """vLLM's paths: POST /score (also /v1/score) and POST /rerank (also /v1/rerank and /v2/rerank)."""

    @app.post("/score")
    @app.post("/v1/score")
    async def create_score(request: ScoreRequest, raw_request: Request):
        return JSONResponse((await scores.create_score(request, raw_request)).model_dump())

    @app.post("/rerank")
    @app.post("/v1/rerank")
    @app.post("/v2/rerank")
    async def do_rerank(request: RerankRequest, raw_request: Request):
        return JSONResponse((await scores.do_rerank(request, raw_request)).model_dump(exclude_none=True))
