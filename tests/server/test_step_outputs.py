"""The server's cumulative snapshots joined from the engine's DELTA outputs (runtime/server/step_outputs.py)."""

import pytest

from fxrewrite.runtime.engine.outputs import CompletionOutput, Logprob, RequestOutput
from fxrewrite.runtime.server.step_outputs import OutputJoiner, PrefixView


def test_prefix_view_reads_the_first_n_items_and_keeps_them_while_the_list_grows():
    items = [10, 11, 12]
    view = PrefixView(items, 2)
    items += [13, 14]
    assert len(view) == 2 and list(view) == [10, 11] and view[-1] == 11 and view[0:5] == [10, 11]
    assert view == [10, 11] and view == (10, 11) and view != [10, 11, 12] and view == PrefixView(items, 2)
    assert bool(PrefixView(items, 0)) is False and 12 not in view and view.index(11) == 1
    with pytest.raises(IndexError, match="index 2 out of range for 2 items"):
        view[2]
    with pytest.raises(TypeError):
        hash(view)


def _delta(text, tokens, finish=None, logprobs=None, prompt_logprobs=None, finished=False, cached=0):
    out = CompletionOutput(0, text, tokens, -1.5 if logprobs is not None else None, logprobs, finish, None)
    return RequestOutput("r", "p", [1, 2, 3], [out], finished, prompt_logprobs=prompt_logprobs,
                         metrics={"num_cached_tokens": cached})


def test_joined_snapshots_are_cumulative_and_earlier_ones_do_not_change():
    joiner = OutputJoiner()
    lp = [{5: Logprob(-0.5, 1, "a")}, {6: Logprob(-1.0, 1, "b")}, {7: Logprob(-2.0, 1, "c")}]
    first = joiner.snapshot(_delta("a", [5], logprobs=lp[:1], prompt_logprobs=[None, {2: Logprob(-3.0, 1, "x")}]))
    second = joiner.snapshot(_delta("bc", [6, 7], logprobs=lp[1:], cached=2))
    last = joiner.snapshot(_delta("", [], finish="length", logprobs=[], finished=True))
    assert (first.choices[0].text, list(first.choices[0].token_ids), list(first.choices[0].logprobs)) == ("a", [5], lp[:1])
    assert (second.choices[0].text, second.choices[0].token_ids, second.choices[0].logprobs) == ("abc", [5, 6, 7], lp)
    assert last.finished and last.choices[0].finish_reason == "length" and last.num_generated_tokens == 3
    assert first.prompt_logprobs == second.prompt_logprobs == last.prompt_logprobs  # sent once, kept
    assert second.num_cached_tokens == 2 and last.prompt_token_ids == (1, 2, 3) and last.num_prompt_tokens == 3
    assert joiner._requests == {}  # finished: forgotten
    again = joiner.snapshot(_delta("z", [9]))  # the id used again: a new request, joined from scratch
    assert again.choices[0].text == "z" and again.choices[0].token_ids == [9]
    joiner.forget("r")
    assert joiner._requests == {}


def test_snapshot_text_over_many_steps_reads_its_own_prefix():
    """Snapshot text lives in one `TextPieces` per choice (joined every 64 pieces): every snapshot of 200 steps still
    reads exactly its own text, whole (`text`) or in part (`text_slice`, what streaming sends), after later steps."""
    import random

    rng, joiner, snapshots, text = random.Random(0), OutputJoiner(), [], ""
    for step in range(200):
        piece = "".join(rng.choice("xy\u00e9\u4e2d") for _ in range(rng.randrange(0, 3)))
        text += piece
        snapshots.append((joiner.snapshot(_delta(piece, [step])).choices[0], text))
    for choice, want in snapshots:
        start = rng.randrange(0, len(want) + 1)
        end = rng.randrange(start, len(want) + 1)
        assert choice.text_len == len(want) and choice.text == want and choice.text_slice(start, end) == want[start:end]
