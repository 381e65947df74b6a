"""PDL switch (`fxrewrite.kernels.pdl`) and the split-K skinny GEMV in the Triton interpreter: FXREWRITE_PDL
parsing, PDL never enabled on a CPU / under the interpreter, split-K configs against the unfused reference
(SiLU-and-mul prologue, bias, partial tiles, uneven K), its counters left at zero, and which kinds get split-K
candidates, the early-load switch and what the kernels read before their wait when compiled for sm90. GPU (PDL inside
CUDA graphs): tests/gpu/test_gpu_pdl.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fxrewrite.kernels import env_choice, on_off_switch, pdl, skinny_gemv
from fxrewrite.kernels.skinny_gemv import CONFIGS, SPLIT_CONFIGS, configs_for, skinny_gemv_ref, skinny_gemv_triton


def test_env_choice(monkeypatch):
    """Every fixed-value switch: its default when unset, its value when valid, else one error wording naming the
    variable, the value and every choice."""
    monkeypatch.delenv("FXREWRITE_TEST_SWITCH", raising=False)
    assert env_choice("FXREWRITE_TEST_SWITCH", "b", ("a", "b", "c")) == "b"
    assert on_off_switch("FXREWRITE_TEST_SWITCH", "off") is False
    monkeypatch.setenv("FXREWRITE_TEST_SWITCH", "a")
    assert env_choice("FXREWRITE_TEST_SWITCH", "b", ("a", "b", "c")) == "a"
    with pytest.raises(ValueError, match="^FXREWRITE_TEST_SWITCH='a': expected 'on' or 'off'$"):
        on_off_switch("FXREWRITE_TEST_SWITCH", "on")
    monkeypatch.setenv("FXREWRITE_TEST_SWITCH", "")
    with pytest.raises(ValueError, match="^FXREWRITE_TEST_SWITCH='': expected 'x', 'y' or 'z'$"):
        env_choice("FXREWRITE_TEST_SWITCH", "x", ("x", "y", "z"))


def test_mode_parsing(monkeypatch):
    monkeypatch.delenv("FXREWRITE_PDL", raising=False)
    assert pdl.mode() == "auto"  # measured faster on the H200 (kernels/pdl.py)
    for value in pdl.MODES:
        monkeypatch.setenv("FXREWRITE_PDL", value)
        assert pdl.mode() == value
    monkeypatch.setenv("FXREWRITE_PDL", "yes")
    with pytest.raises(ValueError, match="FXREWRITE_PDL='yes'"):
        pdl.mode()


def test_never_on_cpu(monkeypatch):
    monkeypatch.setenv("FXREWRITE_PDL", "auto")
    assert not pdl.device_supports_pdl("cpu") and not pdl.pdl_enabled("cpu")
    monkeypatch.setenv("FXREWRITE_PDL", "off")
    assert not pdl.pdl_enabled("cpu")
    monkeypatch.setenv("FXREWRITE_PDL", "on")
    with pytest.raises(RuntimeError, match="no programmatic dependent launch"):
        pdl.pdl_enabled("cpu")


def test_auto_leaves_out_kernels_measured_slower(monkeypatch):
    """On a device with PDL, `auto` launches every kernel with it but those that opt out (in_auto=False: the FP8
    GEMV), `on` every one, `off` none."""
    monkeypatch.setattr(pdl, "device_supports_pdl", lambda device: True)
    monkeypatch.setattr(pdl, "_ENABLED", {})
    want = {"auto": (True, False), "on": (True, True), "off": (False, False)}
    for value, (default_kernel, opted_out) in want.items():
        monkeypatch.setenv("FXREWRITE_PDL", value)
        assert pdl.pdl_enabled("cuda:0") is default_kernel, value
        assert pdl.pdl_enabled("cuda:0", in_auto=False) is opted_out, value


def test_fp8_gemv_forms(monkeypatch):
    """FXREWRITE_PDL_FP8_GEMV under auto: trigger (default) / plain / full -> (launch with PDL, trigger the next
    kernel); FXREWRITE_PDL=on is full and off plain whatever the form; a bad form is a ValueError naming it."""
    monkeypatch.setattr(pdl, "device_supports_pdl", lambda device: True)
    monkeypatch.setattr(pdl, "_ENABLED", {})
    monkeypatch.setenv("FXREWRITE_PDL", "auto")
    monkeypatch.delenv("FXREWRITE_PDL_FP8_GEMV", raising=False)
    assert pdl.fp8_gemv_pdl("cuda:0") == (False, True)
    for form, want in (("plain", (False, False)), ("trigger", (False, True)), ("full", (True, True))):
        monkeypatch.setenv("FXREWRITE_PDL_FP8_GEMV", form)
        assert pdl.fp8_gemv_pdl("cuda:0") == want, form
    for value, want in (("on", (True, True)), ("off", (False, False))):
        monkeypatch.setenv("FXREWRITE_PDL", value)
        assert pdl.fp8_gemv_pdl("cuda:0") == want, value
    monkeypatch.setenv("FXREWRITE_PDL_FP8_GEMV", "early")
    with pytest.raises(ValueError, match="FXREWRITE_PDL_FP8_GEMV='early'"):
        pdl.fp8_gemv_pdl("cuda:0")


def test_early_loads(monkeypatch):
    """FXREWRITE_PDL_EARLY: on (default) reads the caller's static metadata before the wait, under PDL only and only
    where the caller promised it; off never; a bad value is a ValueError naming it (also at the engine's check)."""
    monkeypatch.delenv("FXREWRITE_PDL_EARLY", raising=False)
    assert pdl.early_loads(True, True)
    assert not pdl.early_loads(False, True) and not pdl.early_loads(True, False)
    monkeypatch.setenv("FXREWRITE_PDL_EARLY", "off")
    assert not pdl.early_loads(True, True)
    monkeypatch.setenv("FXREWRITE_PDL_EARLY", "1")
    with pytest.raises(ValueError, match="FXREWRITE_PDL_EARLY='1'"):
        pdl.early_loads(True, True)
    with pytest.raises(ValueError, match="FXREWRITE_PDL_EARLY='1'"):
        pdl.check_environment("cpu")


def test_early_loads_compile_for_sm90():
    """Compiled for sm90 (no GPU; TRITON_INTERPRET unset in a subprocess): with early loads the decode kernel reads
    its metadata (query_start_loc twice, seq_lens, the block table) and asks L2 for the first tile's K and V rows
    before griddepcontrol.wait, its merge reads its metadata, and q/k norm + rotary + cache write its position,
    cos / sin, norm weights and slot, the MoE norm + router its weights; without them nothing is read before the
    wait."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", "tests.kernels.sm90_compile", "pdl-early"], env=env,
                          capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.splitlines()[-1])
    assert all(v == {"ld_global": 0, "prefetch": 0} for v in got["late"].values()), got
    early = got["early"]
    assert early["decode"]["ld_global"] >= 4 and early["decode"]["prefetch"] >= 2, got
    assert early["merge"]["ld_global"] >= 3 and early["qk_norm_rope_cache"]["ld_global"] >= 8, got
    assert early["norm_router"]["ld_global"] >= 2, got  # its gate row and the norm weight


def test_split_k_only_for_kinds_without_a_norm():
    assert configs_for(1) == CONFIGS[1]
    assert configs_for(3, "norm") == CONFIGS[4]
    for kind in ("linear", "silu"):
        assert configs_for(2, kind) == CONFIGS[2] + SPLIT_CONFIGS[2]
        assert configs_for(4, kind) == CONFIGS[4]  # split-K only at 1-2 tokens
        assert configs_for(1, kind, n=2560) == CONFIGS[1] + SPLIT_CONFIGS[1]  # Qwen3-4B o_proj / down_proj
        assert configs_for(1, kind, n=151936) == CONFIGS[1]  # an LM head fills the GPU unsplit
    w, x = torch.zeros(4, 64), torch.zeros(1, 64)
    with pytest.raises(ValueError, match="splits K"):
        skinny_gemv_triton(x, w, norm_weight=torch.ones(64), config=SPLIT_CONFIGS[1][0])


@pytest.mark.parametrize("config", sorted({c for cs in SPLIT_CONFIGS.values() for c in cs}), ids=repr)
def test_split_k_silu_matches_ref(interpret, monkeypatch, config):
    monkeypatch.setenv("FXREWRITE_PDL", "auto")  # the interpreter: launched without PDL
    g = torch.Generator().manual_seed(sum(config))
    n, k = 19, 1792  # a partial last column tile; K = 3.5 tiles of 512: the last split is shorter
    for m in (1, 3):
        x, w = torch.randn(m, 2 * k, generator=g), torch.randn(n, k, generator=g) / k ** 0.5
        bias = torch.randn(n, generator=g)
        got = skinny_gemv_triton(x, w, bias, silu_mul=True, config=config)
        torch.testing.assert_close(got, skinny_gemv_ref(x, w, bias, silu_mul=True), rtol=1e-5, atol=1e-5)
    assert not skinny_gemv._TICKETS[torch.device("cpu")].any()  # every column tile's counter reset


def test_split_k_more_splits_than_tiles(interpret):
    """split_k 8 over 3 K tiles runs 3 splits (no empty split), bf16 plain linear."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(2, 1536, generator=g).bfloat16(), (torch.randn(40, 1536, generator=g) / 40).bfloat16()
    got = skinny_gemv_triton(x, w, config=(16, 512, 4, 8))
    want = skinny_gemv_ref(x, w)
    assert ((got.float() - want.float()).abs().max() / want.float().abs().max()) < 2e-2


def test_prefetch_bytes_setting(monkeypatch):
    monkeypatch.delenv("FXREWRITE_PDL_PREFETCH_BYTES", raising=False)
    assert pdl.prefetch_bytes() == 2048 and pdl.prefetch_lines(4096, 2) == 16
    monkeypatch.setenv("FXREWRITE_PDL_PREFETCH_BYTES", "8192")
    assert pdl.prefetch_lines(4096, 2) == 64
    for bad in ("abc", "-5", "64", "", "²", " 2048", "٣٢٠٠"):
        monkeypatch.setenv("FXREWRITE_PDL_PREFETCH_BYTES", bad)
        with pytest.raises(ValueError, match=f"FXREWRITE_PDL_PREFETCH_BYTES={bad!r}: expected a whole number"):
            pdl.prefetch_bytes()


@pytest.mark.parametrize("var,value,message", [
    ("FXREWRITE_PDL", "yes", "FXREWRITE_PDL='yes': expected 'auto', 'on' or 'off'"),
    ("FXREWRITE_PDL", "on", "FXREWRITE_PDL=on but device cpu has no programmatic dependent launch"),
    ("FXREWRITE_PDL_PREFETCH_BYTES", "-5", "FXREWRITE_PDL_PREFETCH_BYTES='-5'"),
    ("FXREWRITE_GEMV", "yes", "FXREWRITE_GEMV='yes'"),
    ("FXREWRITE_KV_FP8_DOTS", "fp8", "FXREWRITE_KV_FP8_DOTS='fp8': expected 'float16', 'query' or 'float8'"),
    ("FXREWRITE_DECODE_TILE", "rows", "FXREWRITE_DECODE_TILE='rows': expected 'heads' or 'keys'"),
    ("FXREWRITE_COMPILED_FORWARD", "fastest", "FXREWRITE_COMPILED_FORWARD='fastest': expected 'auto', 'compiled' or"),
])
def test_engine_checks_the_kernel_switches_at_start(tiny_model_dir, monkeypatch, var, value, message):
    """A bad switch is one user error when the engine starts, also on a CPU, where no kernel would read it."""
    from fxrewrite.errors import UserInputError
    from fxrewrite.runtime.llm import LLM

    path = tiny_model_dir("qwen3")
    monkeypatch.setenv(var, value)
    with pytest.raises(UserInputError, match=message):
        LLM(str(path), dtype="float32", device="cpu", kv_cache_memory_bytes=1 << 20, max_model_len=64)
