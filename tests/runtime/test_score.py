"""LLM.score on a pooling LLM (vLLM's Score API for an embedding model): each pair's score is the cosine similarity
of `LLM.embed`'s vectors and of transformers' own last-token final hidden states (float32, 1e-5), for 1:1, 1:N and
N:N pairings; each distinct prompt is embedded once; bad pairings and a generating LLM are refused."""

import pytest
import torch

from fxrewrite.runtime.engine.pooling import PoolingParams
from fxrewrite.runtime.engine.scoring import ScoringRequestOutput
from fxrewrite.runtime.llm import LLM

QUERY = "What is the capital of France?"
DOCS = ["The capital of France is Paris.", "Cats sleep a lot.", "a b c d e f g h i j k l m n o p " * 3]


@pytest.fixture(scope="module")
def scorer(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), model_impl="native", runner="pooling", dtype="float32",
               kv_cache_memory_bytes=4 << 20, max_model_len=128, max_num_batched_tokens=32)


def _hf_hidden(model_dir, token_ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        return model.model(input_ids=torch.tensor([token_ids])).last_hidden_state[0, -1]


def _cos(a, b) -> float:
    return float(torch.nn.functional.cosine_similarity(torch.tensor(a), torch.tensor(b), dim=0))


def _embeddings(llm, prompts) -> list[list[float]]:
    return [o.outputs.embedding for o in llm.embed(prompts, use_tqdm=False)]


@pytest.mark.parametrize("data_1, data_2, pairs", [
    (QUERY, DOCS[0], [(0, 0)]),                                 # 1:1, single prompts
    ([QUERY], DOCS, [(0, 0), (0, 1), (0, 2)]),                  # 1:N
    (QUERY, DOCS, [(0, 0), (0, 1), (0, 2)]),                    # 1:N, a bare data_1
    ([QUERY, DOCS[1], DOCS[2]], DOCS, [(0, 0), (1, 1), (2, 2)]),  # N:N pairwise
])
def test_score_is_the_cosine_of_the_embeddings(scorer, data_1, data_2, pairs):
    side_1 = [data_1] if isinstance(data_1, str) else data_1
    side_2 = [data_2] if isinstance(data_2, str) else data_2
    emb_1, emb_2 = _embeddings(scorer, side_1), _embeddings(scorer, side_2)
    outs = scorer.score(data_1, data_2, use_tqdm=False)
    assert len(outs) == len(pairs) and all(isinstance(o, ScoringRequestOutput) and o.finished for o in outs)
    tokenizer = scorer.get_tokenizer()
    pad = [] if tokenizer.pad_token_id is None else [tokenizer.pad_token_id]
    for out, (i, j) in zip(outs, pairs):
        assert isinstance(out.outputs.score, float)
        assert abs(out.outputs.score - _cos(emb_1[i], emb_2[j])) < 1e-5
        assert out.prompt_token_ids == tokenizer.encode(side_1[i]) + pad + tokenizer.encode(side_2[j])  # vLLM's
        assert "_" in out.request_id
    assert not scorer.llm_engine.has_unfinished_requests()


def test_score_equals_transformers_hidden_state_cosine(tiny_llama_dir, scorer):
    tokenizer = scorer.get_tokenizer()
    query = _hf_hidden(tiny_llama_dir, tokenizer.encode(QUERY))
    outs = scorer.score(QUERY, DOCS, use_tqdm=False)
    for out, doc in zip(outs, DOCS):
        want = float(torch.nn.functional.cosine_similarity(query, _hf_hidden(tiny_llama_dir, tokenizer.encode(doc)),
                                                           dim=0))
        assert abs(out.outputs.score - want) < 1e-5
    raw = scorer.score(QUERY, DOCS, use_tqdm=False, pooling_params=PoolingParams(normalize=False))
    assert [round(o.outputs.score, 5) for o in raw] == [round(o.outputs.score, 5) for o in outs]


def test_score_takes_token_ids_truncates_and_embeds_each_text_once(scorer):
    ids = scorer.get_tokenizer().encode(DOCS[0])
    by_text = scorer.score(QUERY, DOCS[0], use_tqdm=False)[0].outputs.score
    by_ids = scorer.score(QUERY, [ids], use_tqdm=False)[0].outputs.score
    assert abs(by_text - by_ids) < 1e-6
    assert abs(scorer.score(QUERY, {"prompt_token_ids": ids}, use_tqdm=False)[0].outputs.score - by_text) < 1e-6
    same = scorer.score([QUERY, QUERY], [QUERY, DOCS[0]], use_tqdm=False)
    assert abs(same[0].outputs.score - 1.0) < 1e-5 and abs(same[1].outputs.score - by_text) < 1e-6
    seen = []
    embed = scorer.embed
    scorer.embed = lambda prompts, *a, **k: seen.append(list(prompts)) or embed(prompts, *a, **k)
    try:
        scorer.score([QUERY, DOCS[0], QUERY], [DOCS[0], QUERY, DOCS[1]], use_tqdm=False)
    finally:
        del scorer.embed
    assert seen == [[QUERY, DOCS[0], DOCS[1]]]  # each distinct text once, in one engine run
    cut = scorer.score(QUERY, DOCS[2], use_tqdm=False, truncate_prompt_tokens=5)[0]
    tail = scorer.score(scorer.get_tokenizer().encode(QUERY)[-5:], [scorer.get_tokenizer().encode(DOCS[2])[-5:]],
                        use_tqdm=False)[0]
    assert abs(cut.outputs.score - tail.outputs.score) < 1e-6


@pytest.mark.parametrize("data_1, data_2, error, words", [
    ([QUERY, DOCS[0]], DOCS, ValueError, r"data_1 has 2 items and data_2 has 3: input lengths must be either 1:1, "
                                         r"1:N or N:N"),
    ([], DOCS, ValueError, "data_1 is empty"),
    (QUERY, [], ValueError, "data_2 is empty"),
    (QUERY, ["ok", [[]]], TypeError, r"data_2\[1\]"),
    (QUERY, ["ok", [5] * 200], ValueError, r"data_2\[1\]: prompt has 200 tokens, more than max_model_len=128"),
    (QUERY, [{"text": "x"}], ValueError, r"data_2\[0\]: .* has neither 'prompt' nor 'prompt_token_ids'"),
    ("", DOCS, ValueError, r"^data_1: prompt is empty"),  # a single prompt is named without an index
    (QUERY, [5] * 200, ValueError, r"^data_2: prompt has 200 tokens"),
    (5, DOCS, TypeError, r"^data_1=5 must be a string, a list of token ids"),  # was "prompts=5", no side named
    (QUERY, None, TypeError, r"^data_2=None must be a string"),
])
def test_bad_score_input_is_refused(scorer, data_1, data_2, error, words):
    with pytest.raises(error, match=words):
        scorer.score(data_1, data_2, use_tqdm=False)
    assert not scorer.llm_engine.has_unfinished_requests()


def test_generating_llm_refuses_score(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), model_impl="native", kv_cache_memory_bytes=1 << 20, max_model_len=64)
    with pytest.raises(ValueError, match=r"LLM.score\(\) is only supported for pooling models.*runner='pooling'"):
        llm.score("a", "b", use_tqdm=False)
