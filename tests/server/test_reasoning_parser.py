"""`--reasoning-parser` (qwen3, deepseek_r1): the parsers on strings, streamed in every split, and the flag."""

import pytest

from fxrewrite.errors import UserInputError
from fxrewrite.runtime.server.reasoning import REASONING_PARSERS, ReasoningSplitter, get_reasoning_parser

QWEN3, R1 = REASONING_PARSERS["qwen3"], REASONING_PARSERS["deepseek_r1"]


@pytest.mark.parametrize("parser, text, expected", [
    (QWEN3, "<think>step 1</think>\n\nThe answer.", ("step 1", "\n\nThe answer.")),
    (QWEN3, "The answer.", (None, "The answer.")),  # enable_thinking=False: no think block in the output
    (QWEN3, "<think>cut short", (None, "cut short")),  # no </think>: all content, <think> removed
    (QWEN3, "<think></think>answer", (None, "answer")),  # empty reasoning
    (QWEN3, "reasoning</think>answer", ("reasoning", "answer")),
    (QWEN3, "<think>all thought</think>", ("all thought", None)),
    (R1, "step 1</think>The answer.", ("step 1", "The answer.")),
    (R1, "<think>step 1</think>The answer.", ("step 1", "The answer.")),
    (R1, "still thinking", ("still thinking", None)),  # no </think>: all reasoning, content None
    (R1, "</think>answer", (None, "answer")),
    (R1, "", (None, None)),
    (R1, "a</think>b</think>c", ("a", "b</think>c")),  # only the first </think> ends the reasoning
])
def test_extract(parser, text, expected):
    assert parser.extract(text) == expected


def _stream(parser, pieces):
    splitter, reasoning, content = ReasoningSplitter(parser), [], []
    for i, piece in enumerate(pieces):
        r, c = splitter.feed(piece, i == len(pieces) - 1)
        reasoning.append(r)
        content.append(c)
    return "".join(reasoning), "".join(content), reasoning, content


@pytest.mark.parametrize("parser, text", [
    (QWEN3, "<think>step 1 < 2</think>\n\nThe answer."), (QWEN3, "The answer <th"), (QWEN3, "<think></think>x"),
    (R1, "step </thin 1</think>The answer."), (R1, "<think>a</think>"), (R1, "thinking </th"), (R1, "</think>"),
])
@pytest.mark.parametrize("step", [1, 2, 3, 5, 100])
def test_stream_in_pieces_matches_the_finished_parse(parser, text, step):
    pieces = [text[i:i + step] for i in range(0, len(text), step)]
    reasoning, content, _, _ = _stream(parser, pieces)
    expected = parser.extract(text)
    assert (reasoning or None, content or None) == expected


def test_stream_holds_back_a_split_end_tag_and_never_sends_it():
    reasoning, content, rs, cs = _stream(R1, ["I think", " so</th", "ink>", "Yes"])
    assert rs == ["I think", " so", "", ""] and cs == ["", "", "", "Yes"]
    assert (reasoning, content) == ("I think so", "Yes")
    _, _, rs, cs = _stream(QWEN3, ["<", "think>", "a<", "/think>b"])
    assert rs == ["", "", "a", ""] and cs == ["", "", "", "b"]


def test_qwen3_streams_a_cut_short_think_block_as_reasoning():
    # the stream cannot know that </think> never comes; the finished parse calls it content (module docstring)
    reasoning, content, _, _ = _stream(QWEN3, ["<think>", "half a thou", "ght"])
    assert (reasoning, content) == ("half a thought", "")


def test_unknown_name_lists_the_choices():
    with pytest.raises(UserInputError, match="deepseek_r1.*qwen3"):
        get_reasoning_parser("qwq")
    assert get_reasoning_parser(None) is None


def test_cli_flag_choices(capsys):
    from fxrewrite.cli import build_parser

    args = build_parser().parse_args(["serve", "m", "--reasoning-parser", "deepseek_r1"])
    assert get_reasoning_parser(args.reasoning_parser) is R1
    assert build_parser().parse_args(["serve", "m"]).reasoning_parser is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "m", "--reasoning-parser", "qwq"])
    err = capsys.readouterr().err
    assert "--reasoning-parser" in err and "'deepseek_r1', 'qwen3'" in err
