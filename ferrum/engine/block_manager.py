"""Paged KV cache bookkeeping: block tables, ref counts and automatic prefix caching.

The KV pool holds `num_blocks` physical blocks of `block_size` token slots each. The executor
owns the K/V tensors; this class only decides which physical block holds which positions of
which sequence (the *block table*, see `ferrum.interfaces.KvCacheHandle`).

Prefix caching follows vLLM's automatic prefix caching: a *full* block whose K/V has been
computed is registered under a hash chain, `hash(parent block hash, block token ids)`, so the
hash of block i names the whole prefix `tokens[: (i + 1) * block_size]`. A new sequence whose
prompt starts with the same full blocks reuses those physical blocks (ref count ++) instead of
recomputing them. Blocks nobody references but that hold a cached prefix stay in an LRU of
evictable blocks and are reclaimed only when the free list is empty.

Every block is in exactly one state:
  free       ref count 0, no hash, on the free list;
  referenced ref count > 0 (held by that many block tables), maybe registered under a hash;
  evictable  ref count 0, registered under a hash, in the LRU.

Per-step calls (`can_append`, `append_slots`, `commit_full_blocks`) cost O(new blocks), not
O(sequence length): each sequence keeps its table, the chain hashes of its full blocks and
how many of them are already committed.

Sliding window (every layer attends to the last W positions only): `free_blocks_before`
releases the blocks no query will read again and puts NULL_BLOCK (-1) in their table entries,
so a long sequence holds about W / block_size blocks; positions keep their table index.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from typing import Sequence

from ferrum.errors import OutOfKvCacheError

# Parent "hash" of block 0. Root inputs are 8*block_size bytes and non-root inputs
# 16 + 8*block_size bytes, so a root block can never collide with a child block by layout;
# a salted root (`salt_root`, 24 bytes) makes a third layout.
_ROOT = b""

# How many waiting prompts keep their block hashes memoised between `can_allocate` calls.
_MEMO_SIZE = 64

# Table entry of a block released by `free_blocks_before` (outside every layer's window).
NULL_BLOCK = -1


def hash_block(parent_hash: bytes, token_ids: Sequence[int]) -> bytes:
    """Chain hash of one full block: blake2b-128 of (parent block hash, block token ids).

    A cryptographic hash rather than Python's `hash()`: the latter is deterministic for ints,
    so crafted prompts could collide with another user's cached prefix and read its K/V
    (vLLM CVE-2025-25183). Token ids are packed as signed 64-bit integers.
    """
    h = hashlib.blake2b(parent_hash, digest_size=16)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def salt_root(cache_salt: str | None) -> bytes:
    """The parent "hash" of block 0 for a request with vLLM's `cache_salt`: requests share
    cached prefix blocks only when their salts are equal (None: the unsalted root), so one
    tenant cannot find out by timing which prompts another sent. blake2b-192 of the salt's
    UTF-8 bytes, 24 bytes long so that a salted root block has a layout of its own."""
    if cache_salt is None:
        return _ROOT
    return hashlib.blake2b(cache_salt.encode("utf-8"), digest_size=24, person=b"ferrum-salt").digest()


class _Seq:
    """Per-sequence state. `block_hashes[i]` is the chain hash of full block i (computed
    lazily, may run ahead of `num_committed`); blocks `[0, num_committed)` have been offered
    to the prefix cache, so `commit_full_blocks` only looks at blocks after them. `root`: the
    parent hash of block 0 (`salt_root`)."""

    __slots__ = ("block_table", "block_hashes", "num_committed", "num_cached_tokens", "num_released", "root")

    def __init__(self, block_table: list[int], block_hashes: list[bytes], num_committed: int,
                 num_cached_tokens: int, root: bytes = _ROOT):
        self.root = root
        self.block_table = block_table
        self.block_hashes = block_hashes
        self.num_committed = num_committed
        self.num_cached_tokens = num_cached_tokens
        self.num_released = 0   # table entries [0, num_released) are NULL_BLOCK


class BlockManager:
    """Allocates KV blocks to sequences and shares full, computed blocks through prefix caching.

    Args:
        num_blocks: physical blocks in the KV pool (the executor's `num_kv_blocks`).
        block_size: token slots per block. Token position p of a sequence lives in slot
            `block_table[p // block_size] * block_size + p % block_size`.
        enable_prefix_caching: when False nothing is ever hashed, cached or hit.

    Call order for one sequence (the scheduler's side):
        1. `lookup_prefix(prompt)` (optional) -> cached tokens c; choose n new tokens;
           `can_allocate(prompt, n)`; `allocate(seq_id, prompt, c + n)` -> c.
        2. the executor computes positions [c, c + n); then
           `commit_full_blocks(seq_id, tokens, c + n)`.
        3. every later step: `can_append` / `append_slots(seq_id, total)` before the forward
           pass, `commit_full_blocks` after it.
        4. `fork(parent, child, prompt_len)` for n > 1 sampling, `free(seq_id)` when finished
           or preempted.
    Sequences are identified by string ids; token lists passed in are only read.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be > 0")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching

        self._ref_count = [0] * num_blocks
        # Stack of truly free blocks; reversed so the first allocations get blocks 0, 1, ...
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        # Unreferenced blocks that still hold a cached prefix, least recently freed first.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._hash_to_block: dict[bytes, int] = {}
        self._block_hash: list[bytes | None] = [None] * num_blocks
        self._seqs: dict[str, _Seq] = {}
        # id(token list) -> (root, copy of its hashed tokens, their block hashes), so a prompt that
        # waits for blocks is hashed once, not on every step. The copy is compared before use
        # (a C-speed list compare, far cheaper than hashing), so a reused id or a list edited
        # in place only costs a rehash, never a wrong hit.
        self._memo: OrderedDict[int, tuple[bytes, list[int], list[bytes]]] = OrderedDict()

        self.prefix_cache_queries = 0  # full prompt blocks eligible for a hit, over allocations
        self.prefix_cache_hits = 0  # of those, blocks found in the cache

    # ------------------------------------------------------------------ queries

    @property
    def num_free_blocks(self) -> int:
        """Blocks allocatable now: truly free plus cached-but-unreferenced (evictable)."""
        return len(self._free) + len(self._evictable)

    @property
    def usage(self) -> float:
        """Fraction of the pool referenced by live sequences, 0.0 .. 1.0."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    @property
    def prefix_cache_hit_rate(self) -> float:
        """prefix_cache_hits / prefix_cache_queries (in blocks), 0.0 before any query."""
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    def __contains__(self, seq_id: str) -> bool:
        return seq_id in self._seqs

    def block_table(self, seq_id: str) -> list[int]:
        """The sequence's block table: physical block ids in position order.

        The live list is returned (no copy, so the per-step cost stays O(1)); it grows in place
        on `append_slots`. Callers must not modify it. Raises KeyError for an unknown id.
        """
        return self._seqs[seq_id].block_table

    def num_cached_tokens(self, seq_id: str) -> int:
        """Tokens the sequence got without computing them: the prefix-cache hit found by
        `allocate`, or the shared prefix given by `fork`. A multiple of block_size."""
        return self._seqs[seq_id].num_cached_tokens

    def lookup_prefix(self, token_ids: Sequence[int], reuse: bool = True, root: bytes = _ROOT) -> int:
        """Prefix-cache hit length in tokens that `allocate(…, token_ids, …)` would return now.

        No side effects on the cache or the stats. At most `len(token_ids) - 1` rounded down to
        a block boundary, so the last prompt token is always computed (it yields the logits).
        reuse=False: 0 (a sequence that must compute every position, e.g. for prompt logprobs;
        its blocks still enter the cache through `commit_full_blocks`). root: the request's
        `salt_root` (only blocks cached under the same root are hits; the same in every method).
        """
        return len(self._match(token_ids, reuse, root)[1]) * self.block_size

    def can_allocate(self, token_ids: Sequence[int], num_new_tokens: int, reuse: bool = True,
                     root: bytes = _ROOT) -> bool:
        """Whether `allocate(seq_id, token_ids, cached + num_new_tokens, reuse)` would succeed now.

        `num_new_tokens` are the prompt tokens scheduled this step beyond the prefix-cache hit.
        Passing a larger number (e.g. the whole chunk including cached tokens) is safe: it only
        asks for more blocks than needed.
        """
        _, hits = self._match(token_ids, reuse, root)
        return self._blocks_needed(hits, len(hits) * self.block_size + num_new_tokens) \
            <= self.num_free_blocks

    def can_append(self, seq_id: str, num_total_tokens: int) -> bool:
        """Whether `append_slots(seq_id, num_total_tokens)` would succeed now."""
        table = self._seqs[seq_id].block_table
        return self._num_blocks_for(num_total_tokens) - len(table) <= self.num_free_blocks

    # ------------------------------------------------------------------ mutations

    def allocate(self, seq_id: str, token_ids: Sequence[int], num_tokens: int, reuse: bool = True,
                 root: bytes = _ROOT) -> int:
        """First scheduling of a sequence: build its block table, reusing cached prefix blocks.

        Looks up the full blocks of `token_ids` in the prefix cache along the hash chain and
        stops at the first miss; the hit is capped at `len(token_ids) - 1` rounded down to a
        block boundary so the last prompt token is always computed. Hit blocks get ref count
        ++ (a hit on an evictable block takes it out of the LRU); fresh blocks are then added
        until the table covers `num_tokens` slots (`num_tokens` = cached + tokens scheduled
        this step; if it is below the hit, the table holds just the hit blocks).

        Returns the number of cached tokens (a multiple of block_size): positions
        `[0, cached)` already hold valid K/V, computation starts at position `cached`.
        reuse=False takes no hit (and counts no query): every block is fresh.
        Raises OutOfKvCacheError when the pool lacks blocks (nothing is changed then), and
        ValueError if `seq_id` already has a table.
        """
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} is already allocated; free it first")
        hashes, hits = self._match(token_ids, reuse, root)
        num_blocks = max(len(hits), self._num_blocks_for(num_tokens))
        needed = self._blocks_needed(hits, num_blocks * self.block_size)
        if needed > self.num_free_blocks:
            raise OutOfKvCacheError(
                f"sequence {seq_id!r} needs {needed} free KV blocks for {num_tokens} tokens "
                f"({len(hits)} blocks from the prefix cache), but only {self.num_free_blocks} "
                f"of {self.num_blocks} blocks (block_size {self.block_size}) are free")

        # Take the hits before any fresh block so eviction cannot reclaim a block just hit.
        for b in hits:
            if self._ref_count[b] == 0:
                del self._evictable[b]
            self._ref_count[b] += 1
        num_hit = len(hits)
        table = hits + [self._take_block() for _ in range(num_blocks - num_hit)]

        # The hashes now belong to the sequence (and grow with its output blocks).
        self._memo.pop(id(token_ids), None)
        self._seqs[seq_id] = _Seq(table, hashes, num_hit, num_hit * self.block_size, root)
        if self.enable_prefix_caching and reuse:
            self.prefix_cache_queries += self._max_hit_blocks(token_ids)
            self.prefix_cache_hits += num_hit
        return num_hit * self.block_size

    def append_slots(self, seq_id: str, num_total_tokens: int) -> None:
        """Grow the block table so it covers `num_total_tokens` slots (chunked prefill, decode).

        A no-op if it already does. Raises OutOfKvCacheError (nothing changed) when the pool
        lacks blocks; the scheduler should check `can_append` first and preempt otherwise.
        """
        if not self.try_append_slots(seq_id, num_total_tokens):
            needed = self._num_blocks_for(num_total_tokens) - len(self._seqs[seq_id].block_table)
            raise OutOfKvCacheError(
                f"sequence {seq_id!r} needs {needed} more KV blocks to hold {num_total_tokens} "
                f"tokens, but only {self.num_free_blocks} of {self.num_blocks} are free")

    def try_append_slots(self, seq_id: str, num_total_tokens: int) -> bool:
        """`append_slots` if `can_append`, in one lookup (the per-sequence decode path of the
        scheduler, which runs for every running sequence every step). False: nothing changed."""
        table = self._seqs[seq_id].block_table
        needed = self._num_blocks_for(num_total_tokens) - len(table)
        if needed <= 0:
            return True
        if needed > self.num_free_blocks:
            return False
        for _ in range(needed):
            table.append(self._take_block())
        return True

    def commit_full_blocks(self, seq_id: str, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        """Register the sequence's newly full and computed blocks in the prefix cache.

        Call after a step computed K/V for positions up to `num_computed_tokens`; `token_ids`
        are the sequence's prompt + output ids. Only blocks after those already committed are
        hashed. A block whose content is already cached in another physical block is not
        registered again (the first copy stays; ours goes to the free list when freed).
        No-op with prefix caching disabled.
        """
        if not self.enable_prefix_caching:
            return
        seq = self._seqs[seq_id]
        bs = self.block_size
        num_full = min(min(num_computed_tokens, len(token_ids)) // bs, len(seq.block_table))
        hashes = seq.block_hashes
        for i in range(seq.num_committed, num_full):
            if i == len(hashes):
                hashes.append(hash_block(hashes[i - 1] if i else seq.root, token_ids[i * bs:(i + 1) * bs]))
            h = hashes[i]
            b = seq.block_table[i]
            if b == NULL_BLOCK:  # released before its commit (sliding window): nothing to cache
                continue
            registered = self._block_hash[b]
            if registered is not None:
                # Shared through fork and already committed by the other holder.
                if registered != h:
                    raise RuntimeError(
                        f"block {b} of sequence {seq_id!r} is cached for other tokens than "
                        f"token_ids[{i * bs}:{(i + 1) * bs}]: the sequence's tokens changed")
            elif h not in self._hash_to_block:
                self._hash_to_block[h] = b
                self._block_hash[b] = h
        if num_full > seq.num_committed:
            seq.num_committed = num_full

    def fork(self, parent_id: str, child_id: str, num_tokens: int) -> int:
        """Give `child_id` a table sharing the parent's first k full blocks (n > 1 sampling).

        k = (num_tokens - 1) // block_size, so the child computes at least its last prompt
        token itself (for its own logits). Shared blocks get ref count ++; the child's further
        blocks come from `append_slots`. Returns k * block_size, the tokens the child need not
        compute. `num_tokens` is normally the prompt length, whose K/V the parent has computed.
        Raises ValueError if the child exists or the parent's table is shorter than k blocks.
        """
        parent = self._seqs[parent_id]
        if child_id in self._seqs:
            raise ValueError(f"sequence {child_id!r} is already allocated; free it first")
        k = max(0, (num_tokens - 1) // self.block_size)
        if k > len(parent.block_table):
            raise ValueError(f"cannot fork {k} blocks from {parent_id!r}, which holds "
                             f"{len(parent.block_table)}")
        shared = parent.block_table[:k]
        for b in shared:
            if b != NULL_BLOCK:
                self._ref_count[b] += 1  # parent holds them, so none is free or evictable
        child = _Seq(shared, parent.block_hashes[:k], min(parent.num_committed, k), k * self.block_size,
                     parent.root)
        child.num_released = min(parent.num_released, k)
        self._seqs[child_id] = child
        return k * self.block_size

    def free_blocks_before(self, seq_id: str, pos: int) -> int:
        """Release the sequence's blocks that hold only positions < pos (sliding window: no
        query of this or a later step reads them) and set their table entries to NULL_BLOCK.
        Released blocks go where `free` puts them (evictable if cached, else free). Costs
        O(newly released blocks). Returns how many were released."""
        seq = self._seqs[seq_id]
        end = min(max(0, pos) // self.block_size, len(seq.block_table))
        table = seq.block_table
        n = 0
        for i in range(seq.num_released, end):
            self._release(table[i])
            table[i] = NULL_BLOCK
            n += 1
        seq.num_released = max(seq.num_released, end)
        return n

    def free(self, seq_id: str) -> None:
        """Drop the sequence's block table: ref count -- on each block, in reverse table order.

        A block reaching 0 goes to the evictable LRU if it holds a cached prefix (most recently
        freed last), else to the free list. Reverse order puts a sequence's tail blocks ahead
        of its head in the LRU: the tail is only useful to a prompt that shares the head, so
        it is evicted first. Unknown ids are ignored (aborting a never-scheduled request).
        """
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            return
        for b in reversed(seq.block_table[seq.num_released:]):
            self._release(b)

    def _release(self, b: int) -> None:
        """Ref count --; at 0 the block becomes evictable if it holds a cached prefix, else free."""
        if b == NULL_BLOCK:  # shared by fork after the parent released it
            return
        self._ref_count[b] -= 1
        if self._ref_count[b] == 0:
            if self._block_hash[b] is not None:
                self._evictable[b] = None
            else:
                self._free.append(b)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix and zero the hit statistics.

        Evictable blocks return to the free list. Blocks of live sequences stay in their tables
        but are unregistered (they go to the free list when freed) and are not re-registered.
        """
        for b in self._evictable:
            self._block_hash[b] = None
            self._free.append(b)
        self._evictable.clear()
        for b in self._hash_to_block.values():
            self._block_hash[b] = None
        self._hash_to_block.clear()
        self._memo.clear()
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # ------------------------------------------------------------------ internals

    def _num_blocks_for(self, num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.block_size))

    def _max_hit_blocks(self, token_ids: Sequence[int]) -> int:
        # Leave at least the last token to compute, so the step produces its logits.
        return max(0, (len(token_ids) - 1) // self.block_size)

    def _blocks_needed(self, hits: list[int], num_tokens: int) -> int:
        """Blocks taken from `num_free_blocks` for a table of hits + fresh blocks covering
        `num_tokens`: fresh blocks plus hits that are currently evictable."""
        total = max(len(hits), self._num_blocks_for(num_tokens))
        live_hits = sum(1 for b in hits if self._ref_count[b] > 0)
        return total - live_hits

    def _match(self, token_ids: Sequence[int], reuse: bool = True,
               root: bytes = _ROOT) -> tuple[list[bytes], list[int]]:
        """Chain hashes of token_ids' full blocks from `root` (computed up to the first miss)
        and the physical blocks of the longest cached prefix, capped by `_max_hit_blocks`.
        Without `reuse`: no hashes (`commit_full_blocks` computes them) and no hits."""
        if not self.enable_prefix_caching or not reuse:
            return [], []
        key = id(token_ids)
        entry = self._memo.get(key)
        # the memo holds the root too: a reused id with the same tokens under another salt
        # must not take the other salt's hashes
        if entry is not None and entry[0] == root and list(token_ids[:len(entry[1])]) == entry[1]:
            _, seen, hashes = entry
            self._memo.move_to_end(key)
        else:
            seen, hashes = [], []
            self._memo[key] = (root, seen, hashes)
            if len(self._memo) > _MEMO_SIZE:
                self._memo.popitem(last=False)
        bs = self.block_size
        hits: list[int] = []
        for i in range(self._max_hit_blocks(token_ids)):
            if i == len(hashes):
                block = list(token_ids[i * bs:(i + 1) * bs])
                hashes.append(hash_block(hashes[i - 1] if i else root, block))
                seen.extend(block)
            b = self._hash_to_block.get(hashes[i])
            if b is None:
                break
            hits.append(b)
        return hashes, hits

    def _take_block(self) -> int:
        """Pop a block for a table (ref count 1): a free one, else evict the LRU cached one.
        Callers have checked `num_free_blocks`."""
        if self._free:
            b = self._free.pop()
        else:
            b, _ = self._evictable.popitem(last=False)
            del self._hash_to_block[self._block_hash[b]]
            self._block_hash[b] = None
        self._ref_count[b] = 1
        return b

    def check_invariants(self) -> None:
        """Assert the bookkeeping is consistent (for tests; O(num_blocks + table lengths)).

        Every block is exactly one of free / referenced / evictable; ref counts equal the
        number of tables holding the block; the hash map and block -> hash agree; committed
        blocks of a table carry their chain hash if registered; num_free_blocks is consistent.
        """
        n = self.num_blocks
        holders = [0] * n
        for seq_id, seq in self._seqs.items():
            live = [b for b in seq.block_table if b != NULL_BLOCK]
            assert len(set(live)) == len(live), f"{seq_id}: block twice in table"
            assert all(b == NULL_BLOCK for b in seq.block_table[:seq.num_released]), seq_id
            assert 0 <= seq.num_committed <= len(seq.block_table), seq_id
            assert len(seq.block_hashes) >= seq.num_committed or not self.enable_prefix_caching, seq_id
            assert seq.num_cached_tokens % self.block_size == 0, seq_id
            for i, b in enumerate(seq.block_table):
                if b == NULL_BLOCK:
                    continue
                assert 0 <= b < n, f"{seq_id}: block id {b} out of range"
                holders[b] += 1
                h = self._block_hash[b]
                if h is not None and i < len(seq.block_hashes):
                    assert h == seq.block_hashes[i], f"{seq_id}: block {b} cached under another prefix"
        free = set(self._free)
        assert len(free) == len(self._free), "block twice on the free list"
        evictable = set(self._evictable)
        for b in range(n):
            ref = self._ref_count[b]
            assert ref == holders[b], f"block {b}: ref count {ref} but {holders[b]} tables hold it"
            states = (b in free) + (ref > 0) + (b in evictable)
            assert states == 1, f"block {b} is in {states} states (free/referenced/evictable)"
            if b in free:
                assert self._block_hash[b] is None, f"free block {b} has a hash"
            if b in evictable:
                assert self._block_hash[b] is not None, f"evictable block {b} has no hash"
        for h, b in self._hash_to_block.items():
            assert self._block_hash[b] == h, f"hash map -> block {b} disagrees with its hash"
        assert sum(h is not None for h in self._block_hash) == len(self._hash_to_block)
        if not self.enable_prefix_caching:
            assert not self._hash_to_block and not evictable
        assert self.num_free_blocks == n - sum(1 for r in self._ref_count if r > 0)
