"""`fxrewrite bench train` on a CPU: two arms in their own processes, 2 steps of a tiny Qwen3."""

from __future__ import annotations

import json

import pytest

from fxrewrite.benchmarks.train import agreement, format_train_table, parse_arm_timeouts, run_train_bench

TINY = {"name": "tiny-train", "tokenizer": "qwen3", "config": {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 32, "intermediate_size": 64,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
    "max_position_embeddings": 256, "vocab_size": 128, "tie_word_embeddings": True, "rms_norm_eps": 1e-6}}


def test_train_bench_smoke(tmp_path):
    config = tmp_path / "tiny-train.json"
    config.write_text(json.dumps(TINY))
    result = run_train_bench(str(config), ["stock", "optimize"], steps=2, warmup=0, batch_size=2, seq_len=16,
                             dtype="float32", device="cpu", out_dir=tmp_path)
    arms = {r["arm"]: r for r in result["arms"]}
    assert set(arms) == {"stock", "optimize"}, result["arms"]
    for r in arms.values():
        assert "error" not in r, r
        assert len(r["losses"]) == 2 and r["tokens_per_s"] > 0
    assert arms["optimize"]["losses_agree"] and arms["optimize"]["max_rel_loss_diff_vs_stock"] < 1e-5
    saved = json.loads((tmp_path / result["files"][0].rsplit("/", 1)[-1]).read_text())
    assert saved["kind"] == "train" and saved["batch_size"] == 2
    assert "| optimize |" in format_train_table(result)


def test_agreement_and_bad_arm():
    records = [{"arm": "stock", "losses": [2.0, 1.0]}, {"arm": "optimize", "losses": [2.001, 1.0]},
               {"arm": "liger", "error": "missing"}]
    agreement(records, 1e-3)
    assert records[1]["losses_agree"] and "losses_agree" not in records[2]
    agreement(records, 1e-4)
    assert not records[1]["losses_agree"]
    with pytest.raises(ValueError, match="unknown train arm"):
        run_train_bench("tiny", ["fast"])


def test_parse_arm_timeouts():
    assert parse_arm_timeouts("45,stock-compile=140") == {"*": 45.0, "stock-compile": 140.0}
    assert parse_arm_timeouts("900") == {"*": 900.0}
    with pytest.raises(ValueError, match="unknown arm 'nope'"):
        parse_arm_timeouts("nope=3")
    with pytest.raises(ValueError, match="not SECONDS"):
        parse_arm_timeouts("liger=fast")


def test_liger_arm_without_liger_kernel_says_what_to_install(monkeypatch):
    import sys

    from fxrewrite.benchmarks.train import _liger_patch
    from fxrewrite.errors import UserInputError

    monkeypatch.setitem(sys.modules, "liger_kernel", None)  # as if not installed
    with pytest.raises(UserInputError, match=r"the liger arm needs liger-kernel .*pip install 'fxrewrite\[bench\]'"):
        _liger_patch("qwen3", None)
