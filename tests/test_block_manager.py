"""BlockManager: block tables, ref counts, prefix caching (hash chain, cap, LRU eviction), fork.

Unit tests pin the documented behaviour; a hypothesis state machine drives random allocate /
append / commit / fork / free / reset sequences over a small pool against a shadow model of
what each physical block holds (as the executor would have written it).
"""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from ferrum.engine.block_manager import BlockManager, salt_root
from ferrum.errors import OutOfKvCacheError


def snapshot(bm: BlockManager):
    """Everything that `allocate` / `append_slots` may change, for 'state unchanged' checks."""
    seqs = {sid: (list(s.block_table), list(s.block_hashes), s.num_committed, s.num_cached_tokens)
            for sid, s in bm._seqs.items()}
    return (seqs, list(bm._ref_count), list(bm._free), list(bm._evictable), dict(bm._hash_to_block),
            list(bm._block_hash), bm.prefix_cache_queries, bm.prefix_cache_hits, bm.num_free_blocks)


def run_prompt(bm: BlockManager, seq_id: str, prompt: list[int]) -> int:
    """Allocate the whole prompt, 'compute' it and commit its full blocks; returns the hit."""
    cached = bm.allocate(seq_id, prompt, len(prompt))
    bm.commit_full_blocks(seq_id, prompt, len(prompt))
    bm.check_invariants()
    return cached


# ---------------------------------------------------------------------------- unit tests


def test_hit_of_two_full_blocks_shares_physical_blocks():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = list(range(10))  # blocks [0..3] [4..7] full, [8, 9] partial
    assert run_prompt(bm, "a", a) == 0
    b = a[:8] + [42, 43]
    assert bm.lookup_prefix(b) == 8
    assert bm.can_allocate(b, 2)
    assert bm.allocate("b", b, 10) == 8
    assert bm.num_cached_tokens("b") == 8
    assert bm.block_table("b")[:2] == bm.block_table("a")[:2]
    assert bm.block_table("b")[2] != bm.block_table("a")[2]  # the partial block is private
    assert [bm._ref_count[x] for x in bm.block_table("b")] == [2, 2, 1]
    # a queried 2 eligible blocks (hit 0), b queried 2 (hit 2)
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (4, 2)
    assert bm.prefix_cache_hit_rate == 0.5
    assert bm.num_free_blocks == 8 - 4
    bm.check_invariants()


def test_hit_is_capped_so_the_last_prompt_token_is_computed():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = list(range(8))  # exactly two full blocks
    run_prompt(bm, "a", a)
    assert len(bm._hash_to_block) == 2
    # Same 8 tokens: a full hit would leave nothing to compute, so only 1 block is reused.
    assert bm.allocate("b", list(a), 8) == 4
    assert bm.block_table("b")[0] == bm.block_table("a")[0]
    assert bm.block_table("b")[1] != bm.block_table("a")[1]
    assert bm.lookup_prefix(a + [99]) == 8
    assert bm.lookup_prefix(a[:5]) == 4
    assert bm.lookup_prefix(a[:4]) == 0
    assert bm.lookup_prefix(a[:1]) == 0
    assert bm.lookup_prefix([]) == 0


def test_hash_chain_depends_on_the_whole_prefix():
    bm = BlockManager(num_blocks=8, block_size=2)
    run_prompt(bm, "a", [1, 1, 2, 2, 5])
    # Block [2, 2] is cached only after [1, 1]: at the root it must miss.
    assert bm.lookup_prefix([2, 2, 2, 2, 5]) == 0
    assert bm.lookup_prefix([3, 3, 2, 2, 5]) == 0
    assert bm.lookup_prefix([1, 1, 2, 2, 5]) == 4
    assert bm.lookup_prefix([1, 1, 2, 3, 5]) == 2


def test_cache_salt_shares_blocks_only_under_the_same_salt():
    """vLLM's cache_salt: a prefix cached under one salt is a miss under another or none (one
    tenant cannot time another's prompts), a hit under the same; blocks committed later, a
    forked child's and the hashes memoised for a reused token list follow the salt."""
    bm = BlockManager(num_blocks=16, block_size=2)
    t1, t2 = salt_root("tenant-1"), salt_root("tenant-2")
    assert salt_root(None) == b"" and len(t1) == 24 and t1 != t2
    prompt = [1, 2, 3, 4, 5]
    assert bm.allocate("a", prompt, 5, root=t1) == 0
    bm.commit_full_blocks("a", prompt, 5)
    assert bm.lookup_prefix(prompt) == 0 and bm.lookup_prefix(prompt, root=t2) == 0
    assert bm.lookup_prefix(prompt, root=t1) == 4 and bm.can_allocate(prompt, 1, root=t1)
    bm.fork("a", "a1", 5)
    bm.append_slots("a1", 7)
    bm.commit_full_blocks("a1", prompt + [6, 7], 7)      # the child's own block, under t1 too
    assert bm.lookup_prefix(prompt + [6, 7, 8], root=t1) == 6
    assert bm.lookup_prefix(prompt + [6, 7, 8]) == 0
    # one token list looked up under t2 first, then t1: its memoised t2 hashes are not reused
    same = list(prompt)
    assert bm.lookup_prefix(same, root=t2) == 0 and bm.lookup_prefix(same, root=t1) == 4
    assert bm.allocate("b", same, 5, root=t1) == 4
    bm.check_invariants()


def test_lru_eviction_order_and_reverse_free_order():
    bm = BlockManager(num_blocks=6, block_size=2)
    run_prompt(bm, "a", [1, 1, 1, 1])  # 2 blocks, both full and committed
    run_prompt(bm, "b", [2, 2, 2, 2])
    a0, a1 = bm.block_table("a")
    b0, b1 = bm.block_table("b")
    bm.free("b")
    bm.free("a")
    # Tail before head; b (freed first) before a.
    assert list(bm._evictable) == [b1, b0, a1, a0]
    assert bm.num_free_blocks == 6
    assert bm.lookup_prefix([1, 1, 1, 1, 0]) == 4

    # A hit takes b's blocks out of the LRU; freeing them again makes them most recent.
    assert bm.allocate("d", [2, 2, 2, 2, 0], 5) == 4
    assert bm.block_table("d")[:2] == [b0, b1]
    assert list(bm._evictable) == [a1, a0]
    bm.free("d")
    assert list(bm._evictable) == [a1, a0, b1, b0]
    assert len(bm._free) == 2  # d's private tail block went back to the free list
    bm.check_invariants()

    # 4 fresh blocks: the 2 truly free ones first, then the LRU cached ones (a's tail, head).
    assert bm.allocate("c", [3] * 7, 7) == 0
    assert bm.block_table("c")[2:] == [a1, a0]
    assert bm.lookup_prefix([1, 1, 1, 1, 0]) == 0
    assert bm.lookup_prefix([2, 2, 2, 2, 0]) == 4
    bm.check_invariants()
    bm.append_slots("c", 9)  # evicts b's tail, keeps its head
    assert bm.block_table("c")[4] == b1
    assert bm.lookup_prefix([2, 2, 2, 2, 0]) == 2
    assert bm.num_free_blocks == 1
    bm.check_invariants()


def test_fork_shares_full_blocks_and_refcounts():
    bm = BlockManager(num_blocks=8, block_size=4)
    prompt = list(range(10))
    run_prompt(bm, "p", prompt)
    assert bm.fork("p", "c", 10) == 8  # (10 - 1) // 4 = 2 blocks
    assert bm.num_cached_tokens("c") == 8
    shared = bm.block_table("p")[:2]
    assert bm.block_table("c") == shared
    assert [bm._ref_count[b] for b in shared] == [2, 2]
    bm.append_slots("c", 10)  # the child prefills tokens 8, 9 itself
    assert bm.block_table("c")[2] not in bm.block_table("p")
    bm.check_invariants()
    # A prompt of exactly 8 tokens shares only 1 block: the child must compute token 7.
    assert bm.fork("p", "c2", 8) == 4
    assert bm.fork("p", "c3", 1) == 0 and bm.block_table("c3") == []
    bm.free("p")
    assert [bm._ref_count[b] for b in shared] == [2, 1]
    bm.check_invariants()
    for s in ("c", "c2", "c3"):
        bm.free(s)
    assert bm.num_free_blocks == 8
    bm.check_invariants()


def test_fork_works_without_prefix_caching():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    run_prompt(bm, "p", list(range(9)))
    assert bm.fork("p", "c", 9) == 8
    assert bm.block_table("c") == bm.block_table("p")[:2]
    bm.free("p")
    bm.free("c")
    assert bm.num_free_blocks == 8
    bm.check_invariants()


def test_free_returns_every_block():
    bm = BlockManager(num_blocks=16, block_size=4)
    run_prompt(bm, "a", list(range(13)))
    run_prompt(bm, "b", list(range(13)))  # hits 3 blocks of a
    bm.append_slots("b", 20)
    bm.fork("b", "c", 13)
    assert bm.num_free_blocks < 16
    for s in ("a", "b", "c"):
        bm.free(s)
        bm.check_invariants()
    assert bm.num_free_blocks == 16
    assert bm.usage == 0.0
    bm.free("never-allocated")  # aborting a waiting request is a no-op
    assert bm.num_free_blocks == 16


def test_disabled_prefix_caching_never_hits():
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    prompt = [1, 2, 3, 4, 5]
    run_prompt(bm, "a", prompt)
    assert bm.lookup_prefix(prompt) == 0
    assert bm.allocate("b", prompt, 5) == 0
    assert not set(bm.block_table("a")) & set(bm.block_table("b"))
    bm.free("a")
    bm.free("b")
    assert run_prompt(bm, "c", prompt) == 0
    assert bm._hash_to_block == {} and not bm._evictable
    assert bm.prefix_cache_queries == 0 and bm.prefix_cache_hit_rate == 0.0


def test_out_of_blocks_leaves_state_unchanged():
    bm = BlockManager(num_blocks=4, block_size=2)
    run_prompt(bm, "a", [1, 1, 2, 2])
    a0 = bm.block_table("a")[0]
    bm.free("a")  # both blocks evictable
    run_prompt(bm, "b", [7])  # one free block used
    # Hits a's first block (evictable) and needs 3 fresh blocks: 4 > 3 allocatable.
    prompt = [1, 1, 9, 9, 9, 9, 9]
    assert bm.lookup_prefix(prompt) == 2
    assert not bm.can_allocate(prompt, 5)
    before = snapshot(bm)
    with pytest.raises(OutOfKvCacheError):
        bm.allocate("c", prompt, 7)
    assert snapshot(bm) == before
    assert "c" not in bm
    # Fewer tokens fit; the evictable hit is reused, not evicted by its own allocation.
    assert bm.can_allocate(prompt, 3)
    assert bm.allocate("c", prompt, 5) == 2
    assert bm.block_table("c")[0] == a0
    bm.check_invariants()
    # append_slots failure is atomic too.
    assert not bm.can_append("b", 9)
    before = snapshot(bm)
    with pytest.raises(OutOfKvCacheError):
        bm.append_slots("b", 9)
    assert snapshot(bm) == before


def test_can_allocate_counts_live_hits_as_free():
    bm = BlockManager(num_blocks=4, block_size=2)
    run_prompt(bm, "a", [1, 1, 2, 2, 3])  # 3 blocks, first 2 committed and live
    assert bm.num_free_blocks == 1
    prompt = [1, 1, 2, 2, 4]
    assert bm.can_allocate(prompt, 1)  # 2 live hits + 1 fresh block
    assert not bm.can_allocate(prompt, 3)
    assert bm.allocate("b", prompt, 5) == 4
    assert bm.num_free_blocks == 0
    bm.check_invariants()


def test_duplicate_content_is_registered_once():
    bm = BlockManager(num_blocks=8, block_size=2)
    prompt = [1, 2, 3, 4, 5]
    # Both scheduled before either committed: no hit, two copies of the same prefix.
    assert bm.allocate("a", prompt, 5) == 0
    assert bm.allocate("b", list(prompt), 5) == 0
    bm.commit_full_blocks("a", prompt, 5)
    bm.commit_full_blocks("b", prompt, 5)
    bm.check_invariants()
    assert set(bm._hash_to_block.values()) == set(bm.block_table("a")[:2])
    bm.free("b")
    bm.free("a")
    assert len(bm._evictable) == 2 and bm.num_free_blocks == 8
    bm.check_invariants()


def test_commit_is_incremental_over_decode():
    bm = BlockManager(num_blocks=8, block_size=2)
    tokens = [5, 6, 7]
    bm.allocate("a", tokens, 3)
    bm.commit_full_blocks("a", tokens, 3)
    assert len(bm._hash_to_block) == 1
    for t in (8, 9, 10):  # each decode step computes the previously sampled token
        tokens.append(t)
        bm.append_slots("a", len(tokens))
        bm.commit_full_blocks("a", tokens, len(tokens))
        bm.check_invariants()
    assert len(bm._hash_to_block) == 3
    bm.free("a")
    assert bm.lookup_prefix(tokens + [0]) == 6  # the output blocks are reusable too


def test_reset_prefix_cache():
    bm = BlockManager(num_blocks=8, block_size=2)
    run_prompt(bm, "a", [1, 2, 3, 4, 5])
    run_prompt(bm, "b", [1, 2, 3, 4, 5])
    bm.free("a")
    bm.reset_prefix_cache()
    bm.check_invariants()
    assert bm.lookup_prefix([1, 2, 3, 4, 5]) == 0
    assert bm.prefix_cache_queries == 0 and bm.prefix_cache_hit_rate == 0.0
    bm.free("b")
    assert bm.num_free_blocks == 8 and not bm._evictable
    bm.check_invariants()


def test_memoised_prompt_hashes_follow_the_list():
    bm = BlockManager(num_blocks=16, block_size=2)
    run_prompt(bm, "a", [1, 2, 3, 4, 5, 6, 7])
    prompt = [1, 2, 3]
    assert bm.lookup_prefix(prompt) == 2
    prompt += [4, 5, 6, 0]  # appending after a lookup is allowed
    assert bm.lookup_prefix(prompt) == 6
    del prompt[3:]  # editing in place is noticed: the memo checks its copy of the tokens
    prompt += [9, 9, 9]
    assert bm.lookup_prefix(prompt) == 2
    prompt[1] = 7
    assert bm.lookup_prefix(prompt) == 0
    prompt[1] = 2
    # Two sequences allocated from one list object must not share a hash list.
    assert bm.allocate("b", prompt, 6) == 2
    assert bm.allocate("c", prompt, 6) == 2
    assert bm._seqs["b"].block_hashes is not bm._seqs["c"].block_hashes
    bm.commit_full_blocks("b", prompt + [1, 1], 8)
    bm.commit_full_blocks("c", prompt + [2, 2], 8)
    bm.check_invariants()
    # num_tokens below the hit keeps the hit blocks; append_slots then adds the rest.
    assert bm.allocate("d", [1, 2, 3, 4, 5, 6, 8], 1) == 6
    assert len(bm.block_table("d")) == 3
    bm.append_slots("d", 7)
    assert len(bm.block_table("d")) == 4
    bm.check_invariants()


def test_misuse_raises():
    bm = BlockManager(num_blocks=4, block_size=2)
    bm.allocate("a", [1, 2, 3], 3)
    with pytest.raises(ValueError):
        bm.allocate("a", [1, 2, 3], 3)
    with pytest.raises(ValueError):
        bm.fork("a", "a", 3)
    with pytest.raises(ValueError):
        bm.fork("a", "b", 99)
    with pytest.raises(KeyError):
        bm.block_table("nope")
    with pytest.raises(ValueError):
        BlockManager(num_blocks=0, block_size=2)


# ---------------------------------------------------------------------------- state machine

BASE_PROMPT = [0, 1, 0, 0, 1, 1, 0, 1, 2, 0, 0, 1, 2, 2, 1, 0]


class _SeqModel:
    def __init__(self, tokens: list[int], computed: int, salt: str | None = None):
        self.tokens = tokens
        self.computed = computed
        self.salt = salt


class BlockManagerMachine(RuleBasedStateMachine):
    """Random engine traffic. `shadow[b][j]` models the K/V in slot j of block b as the whole
    token prefix it was computed from (K/V of position p depends on tokens[: p + 1]) and the
    cache_salt of the request that computed it (a hit must come from the same salt)."""

    @initialize(num_blocks=st.integers(8, 16), block_size=st.integers(2, 4),
                caching=st.sampled_from([True, True, True, False]))
    def setup(self, num_blocks, block_size, caching):
        self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching=caching)
        self.bs = block_size
        self.caching = caching
        self.shadow: list[list] = [[None] * block_size for _ in range(num_blocks)]
        self.model: dict[str, _SeqModel] = {}
        self.next_id = 0

    # -- helpers

    def _pick(self, seed: int) -> str:
        return sorted(self.model)[seed % len(self.model)]

    def _holders(self, block: int) -> int:
        return sum(block in self.bm.block_table(s) for s in self.model)

    def _take_fresh(self, sid: str, blocks: list[int]) -> None:
        """Fresh blocks hold stale K/V and must belong to no other live sequence."""
        for b in blocks:
            for other in self.model:
                assert other == sid or b not in self.bm.block_table(other), \
                    f"fresh block {b} is still referenced by {other}"
            self.shadow[b] = [None] * self.bs

    def _compute(self, sid: str, n: int) -> None:
        """The executor writes K/V of n positions, then the step commits full blocks."""
        s = self.model[sid]
        table = self.bm.block_table(sid)
        for p in range(s.computed, s.computed + n):
            b = table[p // self.bs]
            assert self._holders(b) == 1, f"write into block {b} shared with another sequence"
            self.shadow[b][p % self.bs] = (s.salt, tuple(s.tokens[:p + 1]))
        s.computed += n
        self.bm.commit_full_blocks(sid, s.tokens, s.computed)

    # -- rules

    @rule(cut=st.integers(0, len(BASE_PROMPT)), suffix=st.lists(st.integers(0, 2), max_size=5),
          chunk_seed=st.integers(0, 1000), salt=st.sampled_from([None, None, "a", "b"]))
    def new_sequence(self, cut, suffix, chunk_seed, salt):
        prompt = BASE_PROMPT[:cut] + suffix
        if not prompt:
            prompt = [0]
        sid = f"s{self.next_id}"
        self.next_id += 1
        root = salt_root(salt)
        cached_pred = self.bm.lookup_prefix(prompt, root=root)
        n_new = 1 + chunk_seed % (len(prompt) - cached_pred)
        can = self.bm.can_allocate(prompt, n_new, root=root)
        before = snapshot(self.bm)
        try:
            cached = self.bm.allocate(sid, prompt, cached_pred + n_new, root=root)
        except OutOfKvCacheError:
            assert not can
            assert snapshot(self.bm) == before
            return
        assert can
        assert cached == cached_pred == self.bm.num_cached_tokens(sid)
        assert cached % self.bs == 0 and cached <= len(prompt) - 1
        if not self.caching:
            assert cached == 0
        table = self.bm.block_table(sid)
        assert len(table) * self.bs >= cached + n_new
        k = cached // self.bs
        for i in range(k):  # a hit must hold the K/V of exactly this prompt prefix, of this salt
            want = [(salt, tuple(prompt[:p + 1])) for p in range(i * self.bs, (i + 1) * self.bs)]
            assert self.shadow[table[i]] == want, f"hit block {table[i]} holds {self.shadow[table[i]]}"
        self.model[sid] = _SeqModel(list(prompt), cached, salt)
        self._take_fresh(sid, table[k:])
        self._compute(sid, n_new)

    @precondition(lambda self: self.model)
    @rule(seed=st.integers(0, 1000), chunk_seed=st.integers(0, 1000), token=st.integers(0, 2))
    def step(self, seed, chunk_seed, token):
        """A chunked-prefill chunk, or a decode step once the prompt is computed."""
        sid = self._pick(seed)
        s = self.model[sid]
        if s.computed == len(s.tokens):
            s.tokens.append(token)  # sampled last step; its K/V is computed now
        n = 1 + chunk_seed % (len(s.tokens) - s.computed)
        can = self.bm.can_append(sid, s.computed + n)
        before = snapshot(self.bm)
        old_len = len(self.bm.block_table(sid))
        try:
            self.bm.append_slots(sid, s.computed + n)
        except OutOfKvCacheError:
            assert not can
            assert snapshot(self.bm) == before
            return
        assert can
        self._take_fresh(sid, self.bm.block_table(sid)[old_len:])
        self._compute(sid, n)

    @precondition(lambda self: any(s.computed >= 1 for s in self.model.values()))
    @rule(seed=st.integers(0, 1000), len_seed=st.integers(0, 1000))
    def fork(self, seed, len_seed):
        parents = sorted(sid for sid, s in self.model.items() if s.computed >= 1)
        pid = parents[seed % len(parents)]
        parent = self.model[pid]
        num_tokens = 1 + len_seed % parent.computed
        cid = f"s{self.next_id}"
        self.next_id += 1
        free_before = self.bm.num_free_blocks
        shared = self.bm.fork(pid, cid, num_tokens)
        k = (num_tokens - 1) // self.bs
        assert shared == k * self.bs == self.bm.num_cached_tokens(cid)
        assert self.bm.block_table(cid) == self.bm.block_table(pid)[:k]
        assert self.bm.num_free_blocks == free_before
        self.model[cid] = _SeqModel(list(parent.tokens[:num_tokens]), shared, parent.salt)

    @precondition(lambda self: self.model)
    @rule(seed=st.integers(0, 1000))
    def free(self, seed):
        sid = self._pick(seed)
        self.bm.free(sid)
        del self.model[sid]

    @precondition(lambda self: self.model)
    @rule()
    def finish_oldest(self):
        """Requests mostly finish in arrival order; frees often so cached blocks get evicted."""
        sid = min(self.model, key=lambda s: int(s[1:]))
        self.bm.free(sid)
        del self.model[sid]

    @rule()
    def reset_prefix_cache(self):
        self.bm.reset_prefix_cache()

    # -- invariants

    @invariant()
    def consistent(self):
        if not hasattr(self, "bm"):
            return
        self.bm.check_invariants()
        live = set()
        for sid, s in self.model.items():
            table = self.bm.block_table(sid)
            assert len(table) * self.bs >= s.computed
            live.update(table)
        assert self.bm.num_free_blocks == self.bm.num_blocks - len(live)
        if not self.caching:
            assert self.bm.prefix_cache_hits == 0

    def teardown(self):
        if not hasattr(self, "bm"):
            return
        for sid in list(self.model):
            self.bm.free(sid)
            self.bm.check_invariants()
        assert self.bm.num_free_blocks == self.bm.num_blocks


BlockManagerMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=60, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestBlockManagerMachine = BlockManagerMachine.TestCase
