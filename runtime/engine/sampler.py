"""Turn the last-token logits of a step into next tokens, per request's SamplingParams."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fxrewrite.kernels.greedy_sample import greedy_sample
from fxrewrite.kernels.log_softmax import log_softmax_float32
from fxrewrite.runtime.engine.sequence import Sequence


@dataclass
class SampleResult:
    token_id: int
    logprob: float
    """log-softmax of the raw logits at the sampled token."""
    top_logprobs: dict[int, tuple[float, int]] | None = None
    """{token_id: (logprob, rank)}: the sampled token plus the top `SamplingParams.logprobs`."""


class Sampler:
    """Greedy, temperature, top-k, top-p, min-p, penalties and min_tokens; a seed per request.

    Order (vLLM's): penalties on the raw logits, min_tokens mask, then greedy argmax or
    temperature -> top-k -> top-p -> min-p -> sample. Sampling draws q ~ Exp(1) per vocab entry and takes
    argmax(p / q) (an exact categorical sample); seeded requests draw q from their own generator, so
    their tokens do not depend on what else is in the batch. The noise is drawn on the logits' device
    (one shared generator for unseeded requests, one per seeded sequence), so seeded runs repeat on the
    same kind of device but differ between CPU and GPU.
    """

    def __init__(self, eos_token_ids: set[int], seed: int = 0):
        self.eos_token_ids = sorted(eos_token_ids)
        self.seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def generator_on(self, device: torch.device) -> torch.Generator:
        """The shared generator of unseeded requests on `device` (seeded with `seed` at first use)."""
        generator = self._generators.get(device)
        if generator is None:
            generator = self._generators[device] = torch.Generator(device=device)
            generator.manual_seed(self.seed)
        return generator

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[SampleResult]:
        """logits [S, V] (any float dtype) for sequences `seqs` -> one SampleResult per sequence."""
        return self.sample(logits, seqs).results()

    def sample(self, logits: torch.Tensor, seqs: list[Sequence], bitmask=None) -> SampledTokens:
        """Sample without waiting for the device: the tokens stay on it (for the next step's inputs) and
        travel to the host in the background; `SampledTokens.results()` waits for them.

        bitmask: None, or packed allowed-token bits [S, ceil(V/32)] int32 on the logits' device, one row
        per sequence (structured outputs); tokens whose bit is 0 get -inf.
        """
        if bitmask is None and self.is_plain_greedy(seqs):  # decode graphs capture the same (worker/greedy_head.py)
            return SampledTokens(seqs, *greedy_sample(logits))
        logits = logits.float()
        raw_logprobs = log_softmax_float32(logits)  # accurate on a CPU too (kernels/log_softmax.py)
        edited = logits
        if any(self._changes_logits(s) for s in seqs):
            edited = self._apply_penalties(logits.clone(), seqs)
        if bitmask is not None:
            edited = _mask_grammar_first(logits, edited, bitmask)
        logits = edited
        # Decided from the params on the host: no device->host sync here at all.
        greedy_list = [s.sampling_params.is_greedy for s in seqs]
        tokens = logits.argmax(dim=-1)
        if not all(greedy_list):
            sampled = self._sample(logits, seqs)
            greedy = _to_device(greedy_list, torch.bool, logits.device)
            tokens = torch.where(greedy, tokens, sampled)
        want_logprobs = any(s.sampling_params.logprobs is not None for s in seqs)
        return SampledTokens.from_logprobs(seqs, tokens, raw_logprobs, keep_logprobs=want_logprobs)

    def is_plain_greedy(self, seqs: list[Sequence]) -> bool:
        """Whether `sample` of these sequences (without a bitmask) reduces to `greedy_sample`: all greedy, no
        logprobs asked for, nothing that changes the logits."""
        return all(s.sampling_params.is_greedy and s.sampling_params.logprobs is None and not self._changes_logits(s)
                   for s in seqs)

    @staticmethod
    def _changes_logits(seq: Sequence) -> bool:
        """Whether _apply_penalties would touch this sequence's row (penalties or an active min_tokens)."""
        p = seq.sampling_params
        return p.has_penalties or _num_outputs(seq) < p.min_tokens or p.changes_logits

    def _apply_penalties(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        vocab = logits.shape[-1]
        for i, seq in enumerate(seqs):
            p = seq.sampling_params
            if p.has_penalties:
                out_ids = torch.tensor(seq.output_token_ids, dtype=torch.int64, device=logits.device)
                counts = torch.bincount(out_ids, minlength=vocab)[:vocab].to(logits.dtype)
                if p.repetition_penalty != 1.0:
                    seen = counts > 0
                    seen[torch.tensor(seq.prompt_token_ids, device=logits.device)] = True
                    row = logits[i]
                    penalised = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
                    logits[i] = torch.where(seen, penalised, row)
                logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
            if _num_outputs(seq) < p.min_tokens:
                banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos_token_ids))
                if banned:
                    logits[i, [t for t in banned if t < vocab]] = float("-inf")
            if p.changes_logits:
                _bias_and_ban(logits, i, seq)
        return logits

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        params = [s.sampling_params for s in seqs]
        dev, vocab = logits.device, logits.shape[-1]
        temps = _to_device([p.temperature if not p.is_greedy else 1.0 for p in params], torch.float32, dev)
        logits = logits / temps[:, None]
        k_list = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        if any(p.top_p < 1.0 for p in params):
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            sorted_logits = _filter_sorted(sorted_logits, params, k_list)
            # back to vocabulary order before the draw: a seeded row's noise is per token id, so its token does not
            # depend on whether a neighbour's top-p sent the batch down this path (vLLM's order too)
            return self._draw(torch.empty_like(logits).scatter_(1, order, sorted_logits), seqs)
        # No top-p: no sort (a full-vocabulary sort dominates a small model's decode step). Top-k keeps
        # the logits at or above each row's k-th largest; min-p compares with the top probability.
        if min(k_list) < vocab:
            k_max = max(k for k in k_list if k < vocab)
            kth = logits.topk(k_max, dim=-1).values.gather(
                1, _to_device([min(k, k_max) - 1 for k in k_list], torch.int64, dev)[:, None])
            keep_all = _to_device([k >= vocab for k in k_list], torch.bool, dev)
            logits = logits.masked_fill((logits < kth) & ~keep_all[:, None], float("-inf"))
        if any(p.min_p > 0.0 for p in params):
            probs = torch.softmax(logits, dim=-1)
            min_p = _to_device([p.min_p for p in params], torch.float32, dev)
            logits = logits.masked_fill(probs < min_p[:, None] * probs.amax(dim=-1, keepdim=True), float("-inf"))
        return self._draw(logits, seqs)

    def _draw(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """One categorical sample per row of (filtered) logits [S, V]: argmax(softmax / q), q ~ Exp(1)."""
        probs = torch.softmax(logits, dim=-1)
        return (probs / self._exponential(probs.shape, seqs, logits.device)).argmax(dim=-1)

    def _exponential(self, shape: torch.Size, seqs: list[Sequence], device: torch.device) -> torch.Tensor:
        """q ~ Exp(1) [S, V] on `device`: every row from the shared generator, then seeded rows redrawn
        from their own generator (so the shared stream does not depend on which requests are seeded)."""
        q = torch.empty(shape, device=device).exponential_(generator=self.generator_on(device))
        for i, seq in enumerate(seqs):
            generator = seq.generator_on(device)
            if generator is not None:
                q[i].exponential_(generator=generator)
        return q



def token_columns(tokens: torch.Tensor, raw_logprobs: torch.Tensor) -> torch.Tensor:
    """tokens [S] int64, raw_logprobs [S, V] float32 -> [S, 2] float64: each token id and its logprob (ids below
    2**24 and float32 values are exact in float64, so one copy to the host carries both)."""
    chosen = raw_logprobs.gather(1, tokens[:, None]).squeeze(1)
    return torch.stack([tokens.double(), chosen.double()], dim=1)


def _filter_sorted(sorted_logits: torch.Tensor, params: list, k_list: list[int]) -> torch.Tensor:
    """Top-k, top-p and min-p on logits sorted in descending order [S, V] (the filtered entries -> -inf)."""
    dev, vocab = sorted_logits.device, sorted_logits.shape[-1]
    ranks = torch.arange(vocab, device=dev)[None, :]
    top_k = _to_device(k_list, torch.int64, dev)
    sorted_logits = sorted_logits.masked_fill(ranks >= top_k[:, None], float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    top_p = _to_device([p.top_p for p in params], torch.float32, dev)
    # Drop a token when the tokens before it already reach top_p; the top token always stays.
    drop = (probs.cumsum(dim=-1) - probs) >= top_p[:, None]
    min_p = _to_device([p.min_p for p in params], torch.float32, dev)
    drop |= probs < (min_p[:, None] * probs[:, :1])
    drop[:, 0] = False
    return sorted_logits.masked_fill(drop, float("-inf"))


def _bias_and_ban(logits: torch.Tensor, row: int, seq: Sequence) -> None:
    """logit_bias (added), allowed_token_ids (every other token at -inf) and bad_words (a word's last token at -inf when its other tokens were just
    generated; vLLM's rule) on one row, in place."""
    p, vocab = seq.sampling_params, logits.shape[-1]
    if p.logit_bias:
        ids = [t for t in p.logit_bias if t < vocab]
        bias = torch.tensor([p.logit_bias[t] for t in ids], dtype=logits.dtype)
        logits[row, ids] += bias.to(logits.device, non_blocking=True)
    if p.allowed_token_ids is not None:
        keep = torch.zeros(vocab, dtype=torch.bool)
        keep[[t for t in p.allowed_token_ids if t < vocab]] = True
        logits[row].masked_fill_(~keep.to(logits.device, non_blocking=True), float("-inf"))
    if p.bad_words:
        out = seq.output_token_ids
        banned = [w[-1] for w in seq.bad_words_token_ids
                  if w[-1] < vocab and (len(w) == 1 or out[len(out) - len(w) + 1 :] == w[:-1])]
        if banned:
            logits[row, banned] = float("-inf")


def _mask_grammar_first(logits: torch.Tensor, edited: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """`edited` (logits [S, V] after penalties, min_tokens, allowed_token_ids and bad_words, or `logits` itself when
    nothing edited them) with the grammar's bitmask applied, in place. A row where those bans leave no token the grammar
    allows takes the grammar-masked unedited row instead: the grammar is a hard constraint, the bans give way for that
    step (e.g. min_tokens when the grammar allows only EOS). No host sync."""
    if edited is logits:
        apply_token_bitmask(edited, bitmask)
        return edited
    grammar_only = logits.clone()
    apply_token_bitmask(grammar_only, bitmask)
    apply_token_bitmask(edited, bitmask)
    return torch.where(torch.isneginf(edited).all(-1, keepdim=True), grammar_only, edited)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set logits [S, V] float to -inf in place where bit (token % 32) of bitmask[s, token // 32] is 0
    (xgrammar's packed layout; bitmask [S, ceil(V/32)] int32 on the logits' device). On CUDA: xgrammar's
    one-launch Triton kernel (no host sync); elsewhere `apply_token_bitmask_reference`."""
    if logits.is_cuda:
        import xgrammar  # optional (serve extra); a bitmask only exists when it is installed

        xgrammar.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[-1])
    else:
        apply_token_bitmask_reference(logits, bitmask)


def apply_token_bitmask_reference(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """The torch reference of `apply_token_bitmask` (same contract, in place)."""
    vocab = logits.shape[-1]
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    allowed = ((bitmask[:, :, None] >> shifts) & 1).bool().flatten(1)[:, :vocab]
    logits.masked_fill_(~allowed, float("-inf"))


def _num_outputs(seq: Sequence) -> int:
    """Output tokens so far, counting those still in flight (the step being sampled comes after them)."""
    return seq.num_tokens - seq.num_prompt_tokens


def _to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list on `device` without a stream sync (a plain torch.tensor(..., device=cuda)
    waits for the GPU, which would stall async scheduling)."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


class SampledTokens:
    """One step's sampled tokens: `tokens` [S] int64 stay on the device (the next step's inputs are
    gathered from them); the token ids, their logprobs and, when a request asked for logprobs, their ranks
    and the top `logprobs` entries are computed on the device and copied to pinned host memory in one
    background copy; `results()` waits for that copy (a CUDA event), not for the whole stream, so reading
    a step's logprobs never waits for the step launched after it.
    """

    def __init__(self, seqs: list[Sequence], tokens: torch.Tensor, packed: torch.Tensor, num_top: int = 0,
                 keep_logprobs: bool = False):
        """tokens [S] int64 on the device; packed [S, C] float64: `token_columns`, then (keep_logprobs) each
        token's rank and (num_top > 0) the top num_top logprobs and their ids; copied to the host at once."""
        self.seqs = seqs
        self.tokens = tokens
        self._num_top = num_top
        self._event = None
        if tokens.is_cuda:
            self._host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            self._host.copy_(packed, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:  # a copy too: packed may be a graph's static output, which the next replay overwrites
            self._host = packed.clone()
        self._keep_logprobs = keep_logprobs
        self._results: list[SampleResult] | None = None

    @classmethod
    def from_logprobs(cls, seqs: list[Sequence], tokens: torch.Tensor, raw_logprobs: torch.Tensor,
                      keep_logprobs: bool) -> "SampledTokens":
        """tokens [S] int64 and the log-softmax of the raw logits [S, V] float32; with keep_logprobs, also each
        token's rank and the top max(SamplingParams.logprobs) entries."""
        packed, num_top = token_columns(tokens, raw_logprobs), 0
        if keep_logprobs:
            chosen = packed[:, 1:2].float()
            packed = torch.cat([packed, ((raw_logprobs > chosen).sum(dim=1, keepdim=True) + 1).double()], dim=1)
            num_top = max((s.sampling_params.logprobs or 0) for s in seqs)
        if num_top:
            values, ids = raw_logprobs.topk(num_top, dim=-1)
            packed = torch.cat([packed, values.double(), ids.double()], dim=1)
        return cls(seqs, tokens, packed, num_top, keep_logprobs)

    def results(self) -> list[SampleResult]:
        """One SampleResult per sequence, in order (waits for this step's copy to the host)."""
        if self._results is None:
            if self._event is not None:
                self._event.synchronize()
            rows = self._host.tolist()
            if self._keep_logprobs:
                self._results = [self._build(seq, row) for seq, row in zip(self.seqs, rows)]
            else:  # no top logprobs to build (`_build`'s result without them), one call per row less
                self._results = [SampleResult(int(row[0]), row[1], None) for row in rows[: len(self.seqs)]]
        return self._results

    def token_ids(self) -> list[int]:
        """The sampled token ids, in order (waits for this step's copy to the host, like `results`)."""
        if self._results is not None:
            return [r.token_id for r in self._results]
        if self._event is not None:
            self._event.synchronize()
        return [int(t) for t in self._host[:, 0].tolist()]

    def _build(self, seq: Sequence, row: list[float]) -> SampleResult:
        token, chosen = int(row[0]), row[1]
        num = seq.sampling_params.logprobs
        top = None
        if num is not None and self._keep_logprobs:
            top = {token: (chosen, int(row[2]))}
            k = self._num_top
            for r, (v, t) in enumerate(zip(row[3:3 + num], row[3 + k:3 + k + num]), start=1):
                top.setdefault(int(t), (v, r))
        return SampleResult(token, chosen, top)
