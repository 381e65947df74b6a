"""prepare_inputs with tokens in flight: the steady-decode fast path (numpy) gives what the general loop gives."""

import pytest
import torch

from fxrewrite.runtime.engine.inputs import prepare_inputs
from fxrewrite.runtime.engine.sampling_params import SamplingParams
from fxrewrite.runtime.engine.scheduler import ScheduledSeq
from fxrewrite.runtime.engine.sequence import Sequence


def _decoding(num: int) -> list[Sequence]:
    seqs = []
    for i in range(num):
        seq = Sequence(str(i), list(range(10 + i, 15 + 2 * i)), SamplingParams())
        seq.block_table, seq.num_computed_tokens, seq.num_pending_tokens = [i, num + i, 2 * num + i], len(seq), 1
        seqs.append(seq)
    return seqs


def _fields(inputs) -> list:
    md = inputs.attn_metadata
    return [t.tolist() if isinstance(t, torch.Tensor) else t for t in (
        inputs.input_ids, inputs.positions, inputs.rope_lengths, inputs.logits_indices, inputs.gather_dst,
        inputs.gather_src, inputs.gather_in_order, md.slot_mapping, md.block_tables, md.seq_lens, md.query_start_loc,
        md.max_query_len, md.max_seq_len)] + [inputs.sample_seqs]


@pytest.mark.parametrize("rows_of", [lambda i, n: i, lambda i, n: n - 1 - i])
def test_steady_decode_fast_path_matches_the_loop(rows_of):
    seqs = _decoding(4)
    rows = {seq.seq_id: rows_of(i, len(seqs)) for i, seq in enumerate(seqs)}
    fast = prepare_inputs([ScheduledSeq(s, 1) for s in seqs], 4, torch.device("cpu"), rows)
    # the general loop: a batch that also holds a prefill chunk of a sequence without tokens in flight
    chunk = Sequence("c", list(range(50, 60)), SamplingParams())
    chunk.block_table, chunk.num_computed_tokens = [20, 21, 22], 2
    mixed = prepare_inputs([ScheduledSeq(s, 1) for s in seqs] + [ScheduledSeq(chunk, 3)], 4, torch.device("cpu"), rows)
    assert fast.input_ids.tolist() == [0] * 4 and fast.gather_dst.tolist() == [0, 1, 2, 3]
    assert fast.gather_src.tolist() == [rows[s.seq_id] for s in seqs]
    assert fast.gather_in_order == (rows_of(1, 4) == 1) and not mixed.gather_in_order
    assert mixed.input_ids.tolist()[:4] == [0] * 4 and mixed.gather_dst.tolist() == [0, 1, 2, 3]
    assert mixed.gather_src.tolist() == fast.gather_src.tolist()
    assert mixed.positions.tolist()[:4] == fast.positions.tolist() == [len(s) for s in seqs]
    assert mixed.attn_metadata.slot_mapping.tolist()[:4] == fast.attn_metadata.slot_mapping.tolist()


def test_fast_path_result_equals_the_general_loop(monkeypatch):
    seqs = _decoding(5)
    rows = {seq.seq_id: 4 - i for i, seq in enumerate(seqs)}
    fast = _fields(prepare_inputs([ScheduledSeq(s, 1) for s in seqs], 4, torch.device("cpu"), rows))
    general = _fields(prepare_inputs([ScheduledSeq(s, 1) for s in seqs], 4, torch.device("cpu"), _NoFastPath(rows)))
    assert fast == general


class _NoFastPath(dict):
    """previous_rows that the fast path cannot use (its lookups answer None), while the loop's `get` works."""

    def __init__(self, rows):
        super().__init__(rows)
        self.calls = 0

    def get(self, key, default=None):
        self.calls += 1
        return super().get(key, default) if self.calls > len(self) else None


@pytest.mark.parametrize("broken", ["missing row", "two pending"])
def test_fast_path_errors_are_the_loops(broken):
    seqs = _decoding(3)
    rows = {seq.seq_id: i for i, seq in enumerate(seqs)}
    if broken == "missing row":
        del rows[seqs[1].seq_id]
    else:
        seqs[1].num_pending_tokens = 2
        seqs[1].num_computed_tokens += 1
        seqs[1].block_table.append(99)
    with pytest.raises(RuntimeError, match=f"sequence {seqs[1].seq_id}: token .* is neither on the host nor in flight"):
        prepare_inputs([ScheduledSeq(s, 1) for s in seqs], 4, torch.device("cpu"), rows)
