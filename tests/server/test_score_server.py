"""vLLM's POST /score and POST /rerank on `fxrewrite serve MODEL --runner pooling`: the scores equal `LLM.score`'s
(the cosine similarity of the texts' embeddings) for 1:1, 1:N and N:N pairs and every field-pair name vLLM accepts;
rerank sorts by relevance, cuts to top_n and returns the documents when asked; bad input answers a 400 naming the
field, an unknown model 404, a generating server 400, and a missing API key 401 on every path."""

from __future__ import annotations

import httpx
import pytest

from tests.server.conftest import MODEL_NAME
from tests.server.test_embeddings_server import MAX_LEN, pooling_server  # noqa: F401 (a fixture)

QUERY = "What is the capital of France?"
DOCS = ["Cats sleep a lot.", "The capital of France is Paris.", "France", "dogs and cats"]


@pytest.fixture(scope="module")
def offline(tiny_model_dir):
    """`LLM.score` on its own engine with the server's settings (the server's engine is stepped by its own loop)."""
    from fxrewrite.runtime.llm import LLM

    return LLM(str(tiny_model_dir("qwen3")), runner="pooling", model_impl="native", max_model_len=MAX_LEN,
               kv_cache_memory_bytes=2**20, dtype="float32")


def _post(server, path: str, body: dict) -> httpx.Response:
    with server.http() as http:
        return http.post(path, json=body)


@pytest.mark.parametrize("body, data_1, data_2", [
    ({"text_1": QUERY, "text_2": DOCS[1]}, QUERY, DOCS[1]),
    ({"text_1": QUERY, "text_2": DOCS}, QUERY, DOCS),
    ({"text_1": [QUERY], "text_2": DOCS}, [QUERY], DOCS),
    ({"text_1": DOCS[::-1], "text_2": DOCS}, DOCS[::-1], DOCS),
    ({"data_1": QUERY, "data_2": DOCS}, QUERY, DOCS),
    ({"queries": [QUERY, QUERY], "documents": DOCS[:2]}, [QUERY, QUERY], DOCS[:2]),
    ({"queries": QUERY, "items": DOCS}, QUERY, DOCS),
])
def test_score_equals_llm_score(pooling_server, offline, body, data_1, data_2):
    want = offline.score(data_1, data_2, use_tqdm=False)
    for path in ("/score", "/v1/score"):
        r = _post(pooling_server, path, dict(body, model=MODEL_NAME))
        assert r.status_code == 200, r.text
        got = r.json()
        assert got["object"] == "list" and got["model"] == MODEL_NAME and got["id"].startswith("score-")
        assert isinstance(got["created"], int)
        assert [d["index"] for d in got["data"]] == list(range(len(want)))
        assert all(d["object"] == "score" for d in got["data"])
        for d, w in zip(got["data"], want, strict=True):
            assert abs(d["score"] - w.outputs.score) < 1e-5
        tokens = sum(len(w.prompt_token_ids) for w in want)  # vLLM's count: each pair's two texts and a pad
        assert got["usage"]["prompt_tokens"] == got["usage"]["total_tokens"] == tokens
    assert pooling_server.all_blocks_free()


def test_rerank_sorts_cuts_and_returns_documents(pooling_server, offline):
    want = [o.outputs.score for o in offline.score(QUERY, DOCS, use_tqdm=False)]
    order = sorted(range(len(DOCS)), key=lambda i: -want[i])
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        r = _post(pooling_server, path, {"model": MODEL_NAME, "query": QUERY, "documents": DOCS})
        assert r.status_code == 200, r.text
        got = r.json()
        assert got["model"] == MODEL_NAME and got["id"].startswith("rerank-")
        assert [x["index"] for x in got["results"]] == order
        scores = [x["relevance_score"] for x in got["results"]]
        assert scores == sorted(scores, reverse=True)
        for x in got["results"]:
            assert abs(x["relevance_score"] - want[x["index"]]) < 1e-5
            assert x["document"] == {"text": DOCS[x["index"]]}  # Jina's default, vLLM's only behaviour
        assert got["usage"]["total_tokens"] == got["usage"]["prompt_tokens"] > 0
    top = _post(pooling_server, "/rerank", {"query": QUERY, "documents": DOCS, "top_n": 2,
                                            "return_documents": False}).json()
    assert [x["index"] for x in top["results"]] == order[:2]
    assert all("document" not in x for x in top["results"])
    whole = _post(pooling_server, "/rerank", {"query": QUERY, "documents": DOCS, "top_n": 10}).json()
    assert len(whole["results"]) == len(DOCS)
    one = _post(pooling_server, "/rerank", {"query": QUERY, "documents": DOCS[1]}).json()  # one document, bare
    assert [x["index"] for x in one["results"]] == [0] and abs(one["results"][0]["relevance_score"] - want[1]) < 1e-5


def test_score_truncates_as_embeddings_do(pooling_server):
    long_text = "many words " * 40  # more than MAX_LEN tokens: refused whole, scored by its tail when truncated
    body = {"text_1": QUERY, "text_2": long_text}
    assert _post(pooling_server, "/score", body).status_code == 400
    cut = _post(pooling_server, "/score", dict(body, truncate_prompt_tokens=8))
    assert cut.status_code == 200, cut.text
    assert -1.0 - 1e-6 <= cut.json()["data"][0]["score"] <= 1.0 + 1e-6


@pytest.mark.parametrize("path, body, status, param, words", [
    ("/score", {"text_1": DOCS[:2], "text_2": DOCS[:3]}, 400, "text_2",
     "text_1 has 2 items and text_2 has 3: input lengths must be either 1:1, 1:N or N:N"),
    ("/score", {"text_1": QUERY, "text_2": []}, 400, "text_2", "text_2 is empty"),
    ("/score", {"text_1": [], "text_2": DOCS}, 400, "text_1", "text_1 is empty"),
    ("/score", {"text_1": QUERY, "text_2": ["ok", ""]}, 400, "text_2", "text_2[1] is empty"),
    ("/score", {"text_1": "", "text_2": "ok"}, 400, "text_1", "text_1 is empty"),
    ("/score", {"text_1": QUERY, "text_2": ["ok", "many words " * 30_000]}, 400, "text_2", "text_2[1] has more than"),
    ("/score", {"text_1": QUERY}, 400, "text_2", "give one pair of texts to score"),
    ("/score", {}, 400, "text_1", "got none of them"),
    ("/score", {"text_1": "a", "text_2": "b", "data_1": "c"}, 400, "data_1", "got text_1, text_2, data_1"),
    ("/score", {"queries": "a", "documents": "b", "items": "c"}, 400, "items", "queries and items"),
    ("/score", {"text_1": "a", "text_2": 5}, 400, "text_2", "text_2"),
    ("/score", {"text_1": "a", "text_2": "b", "truncate_prompt_tokens": MAX_LEN + 1}, 400, "truncate_prompt_tokens",
     "truncate_prompt_tokens"),
    ("/score", {"text_1": "a", "text_2": "b", "model": "nope"}, 404, "model", "nope"),
    ("/rerank", {"query": QUERY, "documents": []}, 400, "documents", "documents is empty"),
    ("/rerank", {"documents": DOCS}, 400, "query", "query"),
    ("/rerank", {"query": "", "documents": DOCS}, 400, "query", "query is empty"),
    ("/rerank", {"query": QUERY, "documents": ["a", "many words " * 30_000]}, 400, "documents",
     "documents[1] has more than"),
    ("/rerank", {"query": QUERY, "documents": DOCS, "top_n": "2"}, 400, "top_n", "top_n"),
    ("/rerank", {"query": QUERY, "documents": DOCS, "return_documents": "yes"}, 400, "return_documents",
     "return_documents"),
    ("/v2/rerank", {"query": QUERY, "documents": DOCS, "model": "nope"}, 404, "model", "nope"),
])
def test_bad_score_and_rerank_requests(pooling_server, path, body, status, param, words):
    r = _post(pooling_server, path, body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert pooling_server.all_blocks_free()


@pytest.mark.parametrize("path, body", [("/score", {"text_1": "a", "text_2": "b"}),
                                        ("/rerank", {"query": "a", "documents": ["b"]})])
def test_generate_server_refuses_scores(server, path, body):
    r = _post(server, path, body)
    assert r.status_code == 400, r.text
    assert "--runner pooling" in r.json()["error"]["message"]


@pytest.mark.parametrize("path", ["/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank"])
def test_score_routes_need_the_api_key(pooling_server, path):
    r = httpx.post(f"{pooling_server.base_url}{path}", json={"text_1": "a", "text_2": "b"}, timeout=30)
    assert r.status_code == 401, r.text
