"""CPU smoke test of `python -m fxrewrite.benchmarks.step_exchange`: argument errors, and a short round-trip
run that writes its JSON (the end-to-end part is the TP engine tests' territory)."""

from __future__ import annotations

import json

import pytest

from fxrewrite.benchmarks import step_exchange


@pytest.mark.parametrize("argv, message", [
    (["--world-size", "0"], "--world-size 0: must be a positive integer"),
    (["--repeats", "-1"], "--repeats -1: must be a positive integer"),
    (["--batch-sizes", "1,x"], "--batch-sizes '1,x'"),
    (["--transports", "shm,tcp"], "--transports 'shm,tcp'"),
])
def test_bad_arguments_name_the_value(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        step_exchange.main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_decode_message_is_what_the_encoder_sends_at_steady_state():
    msg = step_exchange.decode_message(32, step=3)
    assert msg.steps.shape == (32, 8) and msg.tokens.tolist() == [45] * 32
    assert int(msg.steps[:, 6].sum()) == len(msg.blocks) == 2  # a new block for every 16th sequence


def test_round_trip_run_writes_its_json(tmp_path):
    # One transport, one worker: a spawned process costs seconds (gloo steps run in the TP engine tests).
    assert step_exchange.main(["--skip-e2e", "--world-size", "1", "--iters", "5", "--batch-sizes", "1,8",
                               "--transports", "shm", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("*-step-exchange-tp1-cpu.json")
    result = json.loads(path.read_text())
    assert result["environment"]["host"] and result["world_size"] == 1
    rows = result["round_trip"]["shm"]
    assert set(result["round_trip"]) == {"shm"} and set(rows) == {"1", "8"}
    assert all(row["median_us"] > 0 and row["message_bytes"] > 0 for row in rows.values())
