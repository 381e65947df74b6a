"""The structured-output benchmark's arms and summaries (no engine: the GPU run is `STEP=structured`)."""

import pytest

import xgrammar  # noqa: E402,F401 - the serve extra (`make setup` installs it): missing is a setup fault

from fxrewrite.benchmarks.structured_outputs import LONG_SCHEMA, _arms, _summary  # noqa: E402


def test_arms_interleave_the_schema_paths():
    arms = _arms(batch=4, output_len=8)
    assert list(arms) == ["none", "json_schema", "json_schema_sequential"]
    none, schema = arms["none"][0], arms["json_schema"][0]
    assert all(p.structured_outputs is None for p in none) and len(none) == 4
    assert all(p.structured_outputs.json == LONG_SCHEMA and p.ignore_eos and p.max_tokens == 8 for p in schema)
    assert [use_process for _, use_process in arms.values()] == [None, True, False]


def test_summary_reports_median_and_spread():
    summary = _summary([100.0, 80.0, 120.0, 90.0])
    assert summary["output_tokens_per_s"] == 95.0 and summary["min"] == 80.0 and summary["max"] == 120.0
    assert summary["spread_fraction"] == pytest.approx(40.0 / 95.0, abs=1e-4)
    assert summary["runs"] == [100.0, 80.0, 120.0, 90.0]
