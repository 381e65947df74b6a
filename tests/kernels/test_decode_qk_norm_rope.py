"""q/k norm + rotary + cache write inside the paged decode kernel (`kernels/decode_qk_norm_rope.py`, through
`paged_attention_qk_norm_rope` with FXREWRITE_DECODE_QK=on) against the unfused pair (`qk_norm_rope_cache`, then the
decode kernel) and the torch references: the same outputs and caches over one-split and split contexts, GQA, neox
and GPT-J rotary, on fresh random inputs (Triton interpreter)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fxrewrite.kernels import decode_qk_norm_rope, paged_attention
from fxrewrite.kernels.paged_decode import paged_decode_triton
from tests.kernels.conftest import make_paged_batch
from tests.kernels.test_rotary import make_cache

HEAD = 16


def _decode_step(contexts, hq, hkv, dtype, seed):
    """A decode batch (one new token per sequence at position context) over caches holding the contexts' keys and
    values, NaN elsewhere (the new token's slot included), and the step's raw q / k / v as slices of one QKV row."""
    torch.manual_seed(seed)
    batch = make_paged_batch([(c, 1) for c in contexts], hq, hkv, HEAD, 16, dtype=dtype, seed=seed)
    positions = torch.tensor(contexts, dtype=torch.int64)
    tables = batch.block_tables.long()
    slots = tables[torch.arange(len(contexts)), positions // 16] * 16 + positions % 16
    for cache in (batch.key_cache, batch.value_cache):
        cache.view(-1, hkv, HEAD)[slots] = float("nan")  # the new token's slot: only the step may write it
    qkv = torch.randn(len(contexts), (hq + 2 * hkv) * HEAD).to(dtype)
    q, k, v = qkv.split([hq * HEAD, hkv * HEAD, hkv * HEAD], dim=-1)
    weights = (torch.rand(HEAD) + 0.5).to(dtype), (torch.rand(HEAD) + 0.5).to(dtype)
    return batch, positions, slots, (q, k, v), weights


def _run(batch, positions, slots, qkv, weights, neox, *, fused: bool, triton: bool, monkeypatch):
    monkeypatch.setenv("FXREWRITE_DECODE_QK", "on" if fused else "off")
    monkeypatch.setenv("FXREWRITE_TRITON", "1" if triton else "0")
    launches = []

    def spy(*args, **kwargs):  # which decode launch ran: with the fused prologue or without
        launches.append(kwargs.get("qk_rope") is not None)
        return paged_decode_triton(*args, **kwargs)

    monkeypatch.setattr(paged_attention, "paged_decode_triton", spy)
    kc, vc = batch.key_cache.clone(), batch.value_cache.clone()
    q, k, v = (x.clone() for x in qkv)
    out = paged_attention.paged_attention_qk_norm_rope(
        positions, q, k, v, weights[0], weights[1], 1e-6, HEAD, make_cache(512, HEAD), neox, kc, vc, slots,
        batch.block_tables, batch.seq_lens, batch.query_start_loc, 1, batch.max_seq_len, HEAD ** -0.5,
        static_metadata=True)
    assert launches == ([fused] if triton else [])
    return out, kc, vc


@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("contexts,heads", [([3, 40, 130, 300], (4, 2)), ([0, 17, 200], (2, 2)), ([64, 129], (8, 1))])
def test_fused_decode_equals_unfused_pair(interpret, monkeypatch, neox, contexts, heads):
    """The fused kernel's output and both caches are bitwise the unfused Triton pair's (the same roundings, the q
    tile built in registers), and within float32 tolerance of the torch references; the new key and value land in
    their slot (no NaN read from it: the writing program's barrier orders its write before its tile loads)."""
    batch, positions, slots, qkv, weights = _decode_step(contexts, *heads, torch.float32, seed=len(contexts))
    fused = _run(batch, positions, slots, qkv, weights, neox, fused=True, triton=True, monkeypatch=monkeypatch)
    pair = _run(batch, positions, slots, qkv, weights, neox, fused=False, triton=True, monkeypatch=monkeypatch)
    ref = _run(batch, positions, slots, qkv, weights, neox, fused=False, triton=False, monkeypatch=monkeypatch)
    assert not fused[0].isnan().any()
    assert torch.equal(fused[0], pair[0])
    for got, want in zip(fused[1:], pair[1:]):
        assert torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0))
    torch.testing.assert_close(fused[0], ref[0], rtol=1e-5, atol=1e-5)
    for got, want in zip(fused[1:], ref[1:]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, equal_nan=True)


def test_bfloat16_fused_equals_pair(interpret, monkeypatch):
    batch, positions, slots, qkv, weights = _decode_step([5, 90, 260], 4, 2, torch.bfloat16, seed=3)
    fused = _run(batch, positions, slots, qkv, weights, True, fused=True, triton=True, monkeypatch=monkeypatch)
    pair = _run(batch, positions, slots, qkv, weights, True, fused=False, triton=True, monkeypatch=monkeypatch)
    for got, want in zip(fused, pair):
        assert torch.equal(got.float().nan_to_num(7.0), want.float().nan_to_num(7.0))


def test_fusable_layouts():
    q = torch.zeros(1, 64)
    assert decode_qk_norm_rope.fusable(q, torch.zeros(1, 16, 1, 16), 16, torch.zeros(8, 16))
    assert not decode_qk_norm_rope.fusable(q, torch.zeros(1, 16, 1, 16, dtype=torch.bfloat16), 16, torch.zeros(8, 16))
    assert not decode_qk_norm_rope.fusable(q, torch.zeros(1, 16, 1, 16), 16, torch.zeros(8, 8))  # partial rotary
    assert not decode_qk_norm_rope.fusable(torch.zeros(1, 48), torch.zeros(1, 16, 1, 24), 24, torch.zeros(8, 24))


def test_switch(monkeypatch):
    monkeypatch.delenv("FXREWRITE_DECODE_QK", raising=False)
    assert decode_qk_norm_rope.enabled() is False
    monkeypatch.setenv("FXREWRITE_DECODE_QK", "on")
    assert decode_qk_norm_rope.enabled() is True
    monkeypatch.setenv("FXREWRITE_DECODE_QK", "1")
    with pytest.raises(ValueError, match="FXREWRITE_DECODE_QK='1'"):
        decode_qk_norm_rope.enabled()


def test_compiles_for_sm90_with_its_early_loads():
    """Compiled for sm90 (no GPU; TRITON_INTERPRET unset in a subprocess): the fused decode kernel builds (PTX and
    cubin), reads its position, cos / sin and both norm weights before griddepcontrol.wait besides the metadata the
    plain kernel reads there (4 loads), and keeps a block barrier for the new key's write."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", "tests.kernels.sm90_compile", "decode-qk"], env=env,
                          capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.splitlines()[-1])
    assert got["before_wait"]["ld_global"] >= 4 + 5 and got["before_wait"]["prefetch"] >= 2, got
    assert got["barriers"] >= 1 and got["mma"], got
