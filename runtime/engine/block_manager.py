"""Paged KV cache bookkeeping: reference-counted blocks and prefix caching by hash of full blocks."""

from __future__ import annotations

from collections import OrderedDict

from fxrewrite.runtime.engine.sequence import Sequence, SequenceStatus


def _needs_prompt_logprobs(seq: Sequence) -> bool:
    return seq.prompt_logprobs is not None and seq.num_prompt_tokens > 1 and seq.prompt_logprobs[-1] is None


class Block:
    """One KV block: `block_size` token slots in every layer's cache."""

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None
        self.token_ids: tuple[int, ...] = ()


def compute_block_hash(prev_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """Hash of a full block, chained with the previous block's hash so equal hashes mean equal prefixes."""
    return hash((prev_hash, token_ids))


def _chain_start(seq: Sequence) -> int | None:
    """Where seq's chain of block hashes starts: its RoPE salt (set by the scheduler where the KV depends on the
    prefill length) and its request's ``cache_salt`` (vLLM's: a tenant's prefix is found only by requests that send
    the same salt, so the time to first token tells nothing across salts)."""
    if seq.cache_salt is None:
        return seq.block_hash_salt
    return hash(("cache_salt", seq.block_hash_salt, seq.cache_salt))


class BlockManager:
    """Hands out KV blocks to sequences.

    A block with ref_count 0 sits in the free list (least recently freed first out) but keeps its hash, so
    a later request with the same prefix can take it back without recomputing; it loses the hash when it
    is reused. Only full blocks whose K/V were computed are hashed (`commit`), so a hit is always valid.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks={num_blocks} and block_size={block_size} must be at least 1")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.hash_to_block_id: dict[int, int] = {}
        self.prefix_cache_queries = 0
        """Prompt tokens looked up in the prefix cache (counted when a sequence gets its blocks)."""
        self.prefix_cache_hits = 0
        """Of those, tokens found already computed."""

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # prefix cache lookup
    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids holding the longest computed prefix of seq (never all its tokens: one must be run).
        None cached for a sequence whose prompt logprobs are still to come: every position must run."""
        if not self.enable_prefix_caching or _needs_prompt_logprobs(seq):
            return []
        hits, bs = [], self.block_size
        hashes = self._token_block_hashes(seq, (seq.num_tokens - 1) // bs)
        for i, h in enumerate(hashes):
            block_id = self.hash_to_block_id.get(h)
            if block_id is None or self.blocks[block_id].token_ids != tuple(seq.token_ids[i * bs : (i + 1) * bs]):
                break
            hits.append(block_id)
        return hits

    def _token_block_hashes(self, seq: Sequence, num_blocks: int) -> list[int]:
        """The chained hashes of seq's first num_blocks full blocks, each computed once per sequence (a
        waiting sequence is looked up every step until admitted, and commit needs the same hashes)."""
        cached, bs = seq.token_block_hashes, self.block_size
        for i in range(len(cached), num_blocks):
            prev = cached[-1] if cached else _chain_start(seq)
            cached.append(compute_block_hash(prev, tuple(seq.token_ids[i * bs : (i + 1) * bs])))
        return cached[:num_blocks]

    # allocation
    def can_allocate(self, seq: Sequence, cached: list[int], num_new_tokens: int) -> bool:
        """Whether a waiting seq can take `cached` blocks plus blocks for `num_new_tokens` more tokens."""
        total = len(cached) * self.block_size + num_new_tokens
        num_new_blocks = self.num_blocks_for(total) - len(cached)
        num_revived = sum(1 for b in cached if self.blocks[b].ref_count == 0)
        return num_new_blocks + num_revived <= self.num_free_blocks

    def allocate(self, seq: Sequence, cached: list[int], num_new_tokens: int) -> None:
        """Give a waiting seq its cached prefix blocks and new blocks; sets num_computed_tokens."""
        if seq.block_table:
            raise RuntimeError(f"sequence {seq.seq_id} already holds blocks")
        for block_id in cached:
            self._take(block_id)
            seq.block_table.append(block_id)
            seq.block_hashes.append(self.blocks[block_id].hash)
        seq.num_computed_tokens = seq.num_cached_tokens = len(cached) * self.block_size
        if self.enable_prefix_caching:
            self.prefix_cache_queries += seq.num_tokens
            self.prefix_cache_hits += seq.num_cached_tokens
        self.append_slots(seq, num_new_tokens)

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        needed = self.num_blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        return needed <= self.num_free_blocks

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grow seq's block table to cover num_computed_tokens + num_new_tokens slots."""
        needed = self.num_blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        if needed > self.num_free_blocks:
            raise RuntimeError(f"need {needed} free KV blocks, have {self.num_free_blocks}")
        for _ in range(needed):
            block_id = next(iter(self.free_block_ids))
            self._take(block_id)
            self._forget(block_id)
            seq.block_table.append(block_id)

    def free(self, seq: Sequence) -> None:
        """Drop seq's references; blocks go back last-first so a prefix's tail is evicted before its head."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_block_ids[block_id] = None
        seq.block_table = []  # a new list: the tensor-parallel executor tracks tables by identity
        seq.block_hashes.clear()
        seq.num_computed_tokens = 0

    def commit_running(self, seqs: list[Sequence]) -> None:
        """:meth:`commit` each running sequence of a step, its no-op test inline (one call per step, not per
        sequence: most decode steps fill no block)."""
        if not self.enable_prefix_caching:
            return
        bs, running = self.block_size, SequenceStatus.RUNNING
        for seq in seqs:
            if seq.status is running and len(seq.block_hashes) < min(seq.num_computed_tokens // bs,
                                                                     len(seq.block_table)):
                self.commit(seq)

    def commit(self, seq: Sequence) -> None:
        """Hash seq's full blocks whose K/V are now computed, so later requests can reuse them."""
        if not self.enable_prefix_caching:
            return
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        if len(seq.block_hashes) >= num_full:  # the common decode step: no block filled up
            return
        hashes = self._token_block_hashes(seq, num_full)
        for i in range(len(seq.block_hashes), num_full):
            h = hashes[i]
            seq.block_hashes.append(h)
            block = self.blocks[seq.block_table[i]]
            if h not in self.hash_to_block_id:
                block.hash = h
                block.token_ids = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
                self.hash_to_block_id[h] = block.block_id

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (vLLM's `reset_prefix_cache`): after a weight update or a sleep the
        cached K/V are stale or gone. Blocks keep their owners; only the hashes go."""
        for block in self.blocks:
            block.hash, block.token_ids = None, ()
        self.hash_to_block_id.clear()

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_block_ids[block_id]
        block.ref_count += 1

    def _forget(self, block_id: int) -> None:
        """A reused block's old contents are about to be overwritten: drop its hash."""
        block = self.blocks[block_id]
        if block.hash is not None and self.hash_to_block_id.get(block.hash) == block_id:
            del self.hash_to_block_id[block.hash]
        block.hash, block.token_ids = None, ()
