"""Sampler: greedy, filters, seeds, penalties, min_tokens, logprobs; SamplingParams validation."""

import math

import pytest
import torch

from fxrewrite.runtime.engine.sampler import Sampler
from fxrewrite.runtime.engine.sampling_params import SamplingParams
from fxrewrite.runtime.engine.sequence import Sequence


def seqs_for(*params, prompt=(1, 2, 3)):
    return [Sequence(str(i), list(prompt), p) for i, p in enumerate(params)]


def test_greedy_is_argmax_and_logprob_is_raw_log_softmax():
    logits = torch.tensor([[0.0, 3.0, 1.0, -1.0]])
    (r,) = Sampler({0})(logits, seqs_for(SamplingParams(temperature=0, logprobs=2)))
    assert r.token_id == 1
    assert r.logprob == pytest.approx(torch.log_softmax(logits, -1)[0, 1].item())
    assert set(r.top_logprobs) == {1, 2} and r.top_logprobs[1][1] == 1


def test_top_k_1_and_tiny_top_p_and_min_p_equal_greedy():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(top_k=1), SamplingParams(top_p=1e-6), SamplingParams(min_p=1.0)]
    results = Sampler(set())(logits, seqs_for(*params))
    assert [r.token_id for r in results] == logits.argmax(-1).tolist()


def test_seeded_sampling_is_reproducible_and_independent_of_batch():
    logits = torch.zeros(1, 1000)
    p = SamplingParams(temperature=1.0, seed=7)
    first = [Sampler(set(), seed=1)(logits, seqs_for(p))[0].token_id for _ in range(1)]
    seq = seqs_for(p)
    again = Sampler(set(), seed=2)(torch.zeros(2, 1000), seqs_for(SamplingParams()) + seq)[1].token_id
    assert first == [again]


@pytest.mark.parametrize("own", [{}, {"min_p": 0.01}, {"top_p": 0.9}])
def test_a_seeded_row_ignores_a_top_p_neighbour(own):
    """A neighbour's top_p sends the batch down the sorted path; the seeded row's token (its noise drawn per token
    id) is the one it gets alone (a fresh user found the sorted order leaking into it)."""
    logits = torch.randn(2, 500, generator=torch.Generator().manual_seed(3))
    p = SamplingParams(temperature=1.0, seed=9, **own)
    sampler, alone, batched = Sampler(set()), seqs_for(p), seqs_for(SamplingParams(temperature=1.0, top_p=0.8), p)
    # three steps each: the sequence's own generator advances alike
    assert [sampler(logits, batched)[1].token_id for _ in range(3)] == [
        sampler(logits[1:], alone)[0].token_id for _ in range(3)]


def test_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    sampler, seq = Sampler(set()), seqs_for(SamplingParams(seed=0))
    counts = torch.zeros(3)
    for _ in range(600):
        counts[sampler(logits, seq)[0].token_id] += 1
    assert torch.allclose(counts / 600, torch.tensor([0.7, 0.2, 0.1]), atol=0.06)


@pytest.mark.parametrize("kwargs, allowed", [
    ({"top_k": 2}, {0, 1}),                 # no top-p: the no-sort path (top-k by threshold)
    ({"min_p": 0.2}, {0, 1, 2}),            # no top-p: min-p against the top probability
    ({"top_k": 3, "top_p": 0.85}, {0, 1}),  # top-p: the sorted path
])
def test_filters_keep_only_allowed_tokens_in_their_proportions(kwargs, allowed):
    probs = torch.tensor([0.5, 0.3, 0.12, 0.05, 0.03])
    sampler, seq = Sampler(set()), seqs_for(SamplingParams(seed=0, **kwargs))
    logits = torch.log(probs)[None].repeat(400, 1)
    tokens = [r.token_id for r in sampler(logits, seq * 400)]
    assert set(tokens) <= allowed and len(set(tokens)) == len(allowed)
    kept = probs[sorted(allowed)] / probs[sorted(allowed)].sum()
    counts = torch.bincount(torch.tensor(tokens), minlength=5)[sorted(allowed)] / 400
    assert torch.allclose(counts, kept, atol=0.07)


def test_logprob_ranks_and_top_entries_per_row():
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=0, logprobs=3), SamplingParams(temperature=0),
              SamplingParams(temperature=1.0, seed=3, logprobs=0), SamplingParams(temperature=0, logprobs=1)]
    results = Sampler(set())(logits, seqs_for(*params))
    ref = torch.log_softmax(logits, -1)
    assert results[1].top_logprobs is None
    for i in (0, 2, 3):
        r = results[i]
        rank = int((ref[i] > ref[i, r.token_id]).sum()) + 1
        assert r.top_logprobs[r.token_id] == (pytest.approx(r.logprob), rank)
        values, ids = ref[i].topk(params[i].logprobs or 1)
        for t, v in zip(ids.tolist()[:params[i].logprobs], values.tolist()):
            assert r.top_logprobs[t][0] == pytest.approx(v)
        assert len(r.top_logprobs) == len({r.token_id, *ids.tolist()[:params[i].logprobs]})


def test_penalties_and_min_tokens():
    logits = torch.tensor([[2.0, 1.9, 0.0, 0.0]])
    (seq,) = seqs_for(SamplingParams(temperature=0, presence_penalty=1.0), prompt=(3,))
    seq.append_token(0)
    assert Sampler(set())(logits, [seq])[0].token_id == 1
    (seq,) = seqs_for(SamplingParams(temperature=0, repetition_penalty=2.0), prompt=(0,))
    assert Sampler(set())(logits, [seq])[0].token_id == 1
    (seq,) = seqs_for(SamplingParams(temperature=0, min_tokens=1, max_tokens=4))
    assert Sampler({0})(logits, [seq])[0].token_id == 1


@pytest.mark.parametrize(
    "kwargs, name",
    [({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"max_tokens": 0}, "max_tokens"),
     ({"temperature": -1}, "temperature"), ({"n": 0}, "n"), ({"min_p": 2}, "min_p")],
)
def test_bad_sampling_params_name_value_and_range(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "kwargs, message",
    [({"top_p": "0.5"}, r"top_p='0.5' must be a number"), ({"temperature": None}, "temperature=None must be a number"),
     ({"max_tokens": 2.5}, "max_tokens=2.5 must be an integer"), ({"n": True}, "n=True must be an integer"),
     ({"logprobs": 1.0}, "logprobs=1.0 must be an integer"), ({"seed": "7"}, "seed='7' must be an integer"),
     ({"stop_token_ids": [1, "2"]}, r"stop_token_ids=\[1, '2'\] must be a list of integers"),
     ({"ignore_eos": "yes"}, "ignore_eos='yes' must be a bool"),  # a non-empty string is truthy: silently on
     ({"skip_special_tokens": None}, "skip_special_tokens=None must be a bool")],
)
def test_wrong_types_name_the_field(kwargs, message):
    """A value of the wrong type is a TypeError naming the field, not a bare comparison error."""
    with pytest.raises(TypeError, match=message):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs, name", [({"seed": 2**64}, "seed"), ({"stop_token_ids": [-1]}, "stop_token_ids"),
                                          ({"temperature": float("nan")}, "temperature=nan must be a finite number"),
                                          ({"top_p": float("inf")}, "top_p=inf must be a finite number")])
def test_out_of_range_ids_and_seed_are_value_errors(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)


FLOAT32_MAX = float(torch.finfo(torch.float32).max)


@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": 1e308}, r"temperature=1e\+308 must be in \[0, 3.4028234663852886e\+38\]"),
    ({"temperature": FLOAT32_MAX * 1.0000001}, "temperature=.* must be in"),
    ({"repetition_penalty": 1e308}, r"repetition_penalty=1e\+308 must be in \[1e-09, 1e\+09\]"),
    ({"repetition_penalty": 1e-39}, r"repetition_penalty=1e-39 must be in \[1e-09, 1e\+09\]"),
    ({"logit_bias": {1: 1e308}}, r"logit_bias=\{1: 1e\+308\} must map .* to numbers in \[-100, 100\]"),
    ({"logit_bias": {1: float("nan")}}, "logit_bias=.* to numbers in"),
])
def test_values_float32_cannot_hold_are_refused(kwargs, message):
    """The sampler computes in float32: a temperature of 1e308 became inf there and logits / inf NaN, so token 0
    was sampled whatever allowed_token_ids or a grammar allowed (the grammar check then failed the whole batch)."""
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs", [{"temperature": FLOAT32_MAX}, {"repetition_penalty": 1e-9},
                                    {"repetition_penalty": 1e9}, {"logit_bias": {1: 100, 4: 100}}])
def test_extreme_accepted_values_sample_an_allowed_token(kwargs):
    logits = torch.tensor([[0.0, 50.0, 1.0, -50.0, 40.0]])
    (seq,) = seqs_for(SamplingParams(seed=0, temperature=kwargs.pop("temperature", 1e-4), allowed_token_ids=[1, 4],
                                     **kwargs), prompt=(0, 1, 3, 4))
    assert {Sampler(set())(logits, [seq])[0].token_id for _ in range(20)} <= {1, 4}


def test_clone_is_a_deep_copy():
    """vLLM's SamplingParams.clone: the copy's lists and dicts are its own."""
    params = SamplingParams(temperature=0.5, stop=["x"], logit_bias={3: 1.0}, allowed_token_ids=[1, 2])
    copy = params.clone()
    assert copy == params and copy is not params
    copy.stop.append("y")
    copy.logit_bias[4] = 2.0
    copy.allowed_token_ids.append(5)
    assert params.stop == ["x"] and params.logit_bias == {3: 1.0} and params.allowed_token_ids == [1, 2]


def test_fields_set_after_construction_are_checked_when_the_request_is_added(tiny_model_dir):
    """A clone edited (vLLM code does so): a bad value is refused by name (n=0 used to queue a request that never
    finished), and a new stop takes effect (stop_strings are derived again)."""
    from fxrewrite.errors import UserInputError
    from fxrewrite.runtime.llm import LLM

    llm = LLM(str(tiny_model_dir("qwen3")), dtype="float32", max_model_len=64)
    base = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    text = llm.generate("Hello", base, use_tqdm=False)[0].outputs[0].text
    for name, value in (("n", 0), ("temperature", float("nan")), ("max_tokens", 0), ("repetition_penalty", 0)):
        bad = base.clone()
        setattr(bad, name, value)
        with pytest.raises((UserInputError, TypeError, ValueError), match=name):
            llm.generate("Hello", bad, use_tqdm=False)
    stop = base.clone()
    stop.stop = [text[3:6]]
    out = llm.generate("Hello", stop, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.text == text[:text.index(text[3:6])]
