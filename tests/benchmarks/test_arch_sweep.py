"""The architecture sweep (`fxrewrite.benchmarks.arch_sweep`): its verdicts, and one architecture end to end."""

from __future__ import annotations

import json

import pytest

from fxrewrite.benchmarks import arch_sweep


def _outputs(tokens, logprobs, margins=None):
    return {"tokens": tokens, "logprobs": logprobs, "margins": margins or [1.0] * len(tokens)}


def test_judge_verdicts():
    oracle = [_outputs([5, 6, 7], [-1.0, -2.0, -3.0], [1.0, 0.5, 0.0001])]
    assert arch_sweep.judge(oracle, [_outputs([5, 6, 7], [-1.0, -2.0, -3.00001])])["status"] == "equal"
    assert arch_sweep.judge(oracle, [_outputs([5, 6, 7], [-1.0, -2.1, -3.0])])["status"] == "logprob_off"
    wrong = arch_sweep.judge(oracle, [_outputs([5, 9, 7], [-1.0, -2.0, -3.0])])
    assert wrong["status"] == "MISMATCH" and wrong["first_diff"] == {
        "prompt": 0, "step": 1, "expected": 6, "got": 9, "margin": 0.5}
    assert arch_sweep.judge(oracle, [_outputs([5, 6, 8], [-1.0, -2.0, -3.0])])["status"] == "near_tie"


def test_prompts_share_a_prefix():
    first, second, third = arch_sweep.prompts(49152)
    assert [len(first), len(second)] == list(arch_sweep.PROMPT_LENGTHS)
    assert third[:arch_sweep.PREFIX_SHARED] == second[:arch_sweep.PREFIX_SHARED] and third != second


def test_one_architecture_end_to_end(capsys):
    """The worker entry point builds a tiny Qwen3, decodes it with transformers and the engine (fusion on and
    off) and prints one equal row per setting."""
    assert arch_sweep.main(["--one", "qwen3", "--fusion", "on,off"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["fusion"], r["status"]) for r in rows] == [(True, "equal"), (False, "equal")]
    assert all(r["logprob_diff"] < 1e-4 and r["first_diff"] is None for r in rows)


def test_bad_arguments_exit_naming_them(capsys):
    for argv, message in ((["--archs", "llama,lama"], "unknown model_type 'lama'"), (["--jobs", "0"], "--jobs 0"),
                          (["--archs", "llama,"], "an empty name"), (["--out", "/"], "cannot append to it"),
                          (["--timeout", "0"], "--timeout 0.0: expected a positive finite"),
                          (["--timeout", "nan"], "--timeout nan"), (["--timeout", "inf"], "--timeout inf"),
                          (["--fusion", "bogus"], "--fusion 'bogus': expected on, off or on,off"),
                          (["--fusion", "on,"], "--fusion 'on,'"),
                          (["--engine-args", '{"bogus_kw": 1}'], "unexpected keyword argument(s) 'bogus_kw'"),
                          (["--engine-args", "[1]"], "a JSON object of LLM() keyword arguments is expected"),
                          (["--engine-args", '{"tensor_parallel_size": 0}'], "tensor_parallel_size=0"),
                          (["--engine-args", '{"model": "x"}'], "'model': set by the sweep itself"),
                          (["--engine-args", "{bad"], "'{bad' is not valid JSON"),
                          (["--fusion", "on,on"], "--fusion 'on,on'"),
                          (["--archs", "llama,qwen3,llama"], "'llama' named more than once")):
        with pytest.raises(SystemExit) as exit_info:
            arch_sweep.main(argv)
        assert exit_info.value.code == 2 and message in capsys.readouterr().err
