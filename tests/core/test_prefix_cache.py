"""Automatic prefix caching: named, shared, refcounted blocks in both tiers.

The block manager's accounting is checked directly; the loop's behaviour on the hashing fake
runner, whose next token hashes the context it reads through the block tables, so any block
shared or reused wrongly changes the output; and the real engine's greedy tokens with and
without the cache, under preemption.
"""

from __future__ import annotations

import pytest
from conftest import MLFQ_ALWAYS, make_requests
from fakes import HashRunner, decode_chars
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from quanta.core.blocks import BlockManager, Tier
from quanta.core.clock import VirtualClock
from quanta.core.config import SchedulerConfig
from quanta.core.lookups import LookupMemo
from quanta.core.loop import EngineLoop
from quanta.core.prefix import block_hashes, cacheable_blocks
from quanta.core.request import Request, SamplingParams
from quanta.policies import make_policy

BLOCK = 4


def shared(n: int, prefix: int, own: int, *, max_tokens: int = 6, seed: int = 0) -> list[Request]:
    """``n`` requests whose prompts share their first ``prefix`` tokens, then ``own`` of
    their own."""
    common = [(3 * j + 1) % 47 + 2 for j in range(prefix)]
    return [
        Request(
            request_id=f"s{i}",
            prompt_token_ids=common + [(11 * i + 5 * j) % 43 + 3 for j in range(own)],
            params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
            arrival_time=i * 1e-3,
            seed=seed + i,
        )
        for i in range(n)
    ]


def names(req: Request) -> list[bytes]:
    return block_hashes(req, BLOCK, cacheable_blocks(req, BLOCK))[: cacheable_blocks(req, BLOCK)]


def fresh_hit(bm: BlockManager, req: Request) -> tuple[tuple[Tier, int], ...]:
    """The longest cached prefix of ``req`` as a lookup made now would find it."""
    found = []
    for name in names(req):
        tier, b = Tier.DEVICE, bm.cached_block(Tier.DEVICE, name)
        if b is None:
            tier, b = Tier.HOST, bm.cached_block(Tier.HOST, name)
        if b is None:
            break
        found.append((tier, b))
    return tuple(found)


def check_lookups(loop: EngineLoop) -> None:
    """What the next step's lookups leave for every waiting request (kept ones and redone
    ones alike) is what looking each one up afresh finds."""
    waiting = [r for r in loop._view(0.0).waiting if loop.blocks.kind_of(r.request_id) is None]
    loop.blocks.forget_lookups()
    loop._look_up_prefixes(waiting)
    for r in waiting:
        expected = fresh_hit(loop.blocks, r)
        hit = loop.blocks.prefix_hit(r.request_id)
        assert (hit.blocks if hit else ()) == expected, r.request_id
        assert r.num_cached_tokens == BLOCK * len(expected), r.request_id


def resident(bm: BlockManager, req: Request) -> None:
    """``req``'s prompt computed into fresh device blocks and named."""
    assert bm.allocate_slots(req.request_id, req.num_prompt_tokens) is not None
    req.num_computed_tokens = req.num_prompt_tokens
    full = req.num_computed_tokens // BLOCK
    bm.name_blocks(req.request_id, block_hashes(req, BLOCK, full)[:full])


# -- names ---------------------------------------------------------------------------------
def test_a_block_name_covers_its_whole_prefix_and_the_last_token_is_never_a_hit():
    a, b = shared(2, 8, 5)
    c = Request("c", [99, *a.prompt_token_ids[1:]], SamplingParams(), 0.0, 0)
    assert names(a)[:2] == names(b)[:2] and names(a)[2] != names(b)[2]
    assert names(c)[1] != names(a)[1]  # same tokens 4..7, different prefix
    exact = Request("e", list(range(8)), SamplingParams(), 0.0, 0)
    assert cacheable_blocks(exact, BLOCK) == 1  # 8 tokens: the second block holds the last


# -- the block manager ---------------------------------------------------------------------
def test_a_cached_prefix_is_shared_counted_once_and_outlives_its_requests():
    bm = BlockManager(BLOCK, 10, 0, prefix_caching=True)
    a, b = shared(2, 8, 3)
    resident(bm, a)
    assert bm.lookup("s1", names(b)) == 8
    bm.pin_prefix("s1")
    assert bm.load_prefix("s1") == []
    assert bm.block_table("s1")[:2] == bm.block_table("s0")[:2]
    assert bm.num_free(Tier.DEVICE) == 10 - 3
    bm.check_integrity()
    bm.free("s0")
    assert bm.num_free(Tier.DEVICE) == 10 - 2  # its own last block only
    bm.free("s1")
    assert bm.num_free(Tier.DEVICE) == 10 and bm.num_cached(Tier.DEVICE) == 2
    assert bm.lookup("again", names(b)) == 8  # still cached while free
    bm.check_integrity()
    assert bm.all_free()


def test_eviction_takes_never_named_blocks_first_then_a_prefix_from_its_end():
    bm = BlockManager(BLOCK, 4, 0, prefix_caching=True)
    old, new = shared(1, 0, 9)[0], shared(2, 0, 9)[1]
    resident(bm, old)  # 3 blocks, 2 named
    bm.free("s0")
    resident(bm, new)  # the 2 plain blocks, then old's last named one
    bm.free("s1")
    assert bm.lookup("x", names(old)) == 4  # its first block is still cached
    assert bm.lookup("y", names(new)) == 8
    bm.check_integrity()


def test_an_evicted_device_block_goes_to_the_host_and_comes_back_by_copy():
    bm = BlockManager(BLOCK, 3, 4, prefix_caching=True)
    a = shared(1, 8, 1)[0]
    resident(bm, a)
    bm.free("s0")
    assert bm.allocate_slots("other", 3 * BLOCK) is not None  # evicts both named blocks
    offloads = bm.take_offloads()
    assert len(offloads) == 2 and bm.num_cached(Tier.HOST) == 2
    assert bm.num_free(Tier.HOST) == 4  # cached on the host, still free for anything
    bm.free("other")
    twin = shared(1, 8, 2)[0]
    assert bm.lookup("t", names(twin)) == 8
    bm.pin_prefix("t")
    loads = bm.load_prefix("t")
    assert loads is not None and sorted(h for h, _ in loads) == sorted(h for _, h in offloads)
    bm.check_integrity()


def test_a_swap_out_copies_only_what_the_host_does_not_hold():
    bm = BlockManager(BLOCK, 8, 8, prefix_caching=True)
    a = shared(1, 8, 2)[0]
    resident(bm, a)
    first = bm.swap_out("s0", a.num_computed_tokens)
    assert first is not None and len(first) == 3
    assert bm.swap_in("s0") is not None
    again = bm.swap_out("s0", a.num_computed_tokens)
    assert again is not None and len(again) == 1  # only the partly filled last block
    bm.check_integrity()
    bm.free("s0")
    assert bm.all_free()


def test_a_block_the_host_caches_is_a_free_checkpoint_and_is_never_copied_over():
    bm = BlockManager(BLOCK, 8, 8, prefix_caching=True)
    a, b = shared(2, 8, 2)
    resident(bm, a)
    assert bm.swap_out("s0", a.num_computed_tokens) is not None  # the host caches 2 blocks
    resident(bm, b)  # its first two blocks hold the same prefix (computed again)
    copies = bm.checkpoint("s1", b.num_computed_tokens)
    assert copies is not None and len(copies) == 1  # only its own partly filled block
    host_of_a = bm.block_table("s0")[:2]
    assert all(bm.refs(Tier.HOST, blk) == 2 for blk in host_of_a)
    bm.confirm_checkpoints()
    again = bm.swap_out("s1", b.num_computed_tokens)
    assert again == []  # the checkpoint is complete: no copy, nothing written over
    bm.check_integrity()
    bm.free("s0")
    bm.free("s1")
    assert bm.all_free()


def test_freeing_a_request_never_frees_a_block_another_still_reads():
    bm = BlockManager(BLOCK, 6, 6, prefix_caching=True)
    a, b = shared(2, 8, 2)
    resident(bm, a)
    bm.lookup("s1", names(b))
    bm.pin_prefix("s1")
    bm.load_prefix("s1")
    assert bm.swap_out("s0", a.num_computed_tokens) is not None
    shared_blocks = bm.block_table("s1")[:2]
    assert all(bm.refs(Tier.DEVICE, blk) == 1 for blk in shared_blocks)
    bm.free("s0")
    assert all(bm.refs(Tier.DEVICE, blk) == 1 for blk in shared_blocks)
    bm.check_integrity()


def test_a_reset_forgets_every_name_and_keeps_blocks_in_use():
    bm = BlockManager(BLOCK, 6, 6, prefix_caching=True)
    a = shared(1, 8, 2)[0]
    resident(bm, a)
    assert bm.reset_prefix_cache() == 2
    assert bm.lookup("x", names(a)) == 0 and bm.num_blocks("s0") == 3
    bm.check_integrity()


# -- lookups kept across steps -------------------------------------------------------------
def test_the_memo_keeps_a_lookup_until_a_name_it_read_changes():
    memo = LookupMemo()
    memo.keep("a", [b"n0", b"n1", b"n2"])  # found n0 n1, stopped at n2
    memo.keep("b", [b"n0"])  # stopped at n0
    memo.changed([b"n3", b"zz"])  # past where either walk stopped: both hold
    assert "a" in memo and "b" in memo
    memo.changed([b"n2"])  # a block for where a's walk stopped
    assert "a" not in memo and "b" in memo
    assert memo.resume_at("a") == 2 and memo.resume_at("b") == 0  # n0 and n1 still hold
    memo.keep("d", [b"n5", b"n6", b"n7"])
    memo.changed([b"n7"])
    memo.changed([b"n5"])  # before what a stale lookup kept: it keeps less
    assert memo.resume_at("d") == 0 and "d" not in memo
    memo.drop("d")
    memo.keep("a", [b"n0", b"n1", b"n2", b"n3"])
    memo.changed([b"n0"])  # read by both
    assert len(memo) == 0 and not memo._readers  # no reader left behind
    memo.keep("c", [])  # nothing cacheable: nothing can change its answer
    memo.changed([b"n0"])
    assert "c" in memo
    memo.drop("c")
    assert "c" not in memo


def test_only_stale_lookups_are_redone_and_each_change_makes_its_readers_stale():
    bm = BlockManager(BLOCK, 8, 4, prefix_caching=True)
    a, b, c = shared(3, 8, 6)  # two shared blocks, then their own
    other = make_requests(1, prompt_len=9)[0]
    resident(bm, a)
    for r in (b, c, other):
        r.num_cached_tokens = bm.lookup(r.request_id, names(r))
    assert bm.stale_lookups([b, c, other]) == []
    bm.forget_lookups()  # a's blocks were named before: the lookups read what they found
    assert bm.stale_lookups([b, c, other]) == [b, c]  # a spurious change costs a lookup
    for r in (b, c):
        r.num_cached_tokens = bm.lookup(r.request_id, names(r))
    bm.forget_lookups()
    assert bm.stale_lookups([b, c, other]) == []
    bm.free(a.request_id)  # cached while free: nothing changed
    assert bm.allocate_slots("big", 5 * BLOCK) is not None  # never-named blocks first
    bm.forget_lookups()
    assert bm.stale_lookups([b, c, other]) == []
    assert bm.allocate_slots("big2", BLOCK) is not None  # evicts a's own block, to the host
    bm.forget_lookups()
    assert bm.stale_lookups([b, c, other]) == []  # nobody read its name
    assert bm.allocate_slots("big3", BLOCK) is not None  # evicts the second shared block
    bm.forget_lookups()
    assert bm.stale_lookups([b, c, other]) == [b, c]
    for r in (b, c):
        assert bm.lookup(r.request_id, names(r)) == 8  # the second block now from the host
        assert bm.prefix_hit(r.request_id).blocks == fresh_hit(bm, r)
        assert bm.prefix_hit(r.request_id).of(Tier.HOST)
    bm.free("big")
    bm.pin_prefix(b.request_id)  # b holds blocks: no lookup of it holds
    assert bm.load_prefix(b.request_id)  # copies the host block back, named on the device
    assert bm.stale_lookups([b, c]) == [b]
    bm.forget_lookups()
    assert bm.stale_lookups([b, c]) == [b, c]  # c's second block is on the device again
    assert bm.lookup(c.request_id, names(c)) == 8
    assert bm.prefix_hit(c.request_id).blocks == fresh_hit(bm, c)
    assert not bm.prefix_hit(c.request_id).of(Tier.HOST)
    bm.reset_prefix_cache()
    assert bm.stale_lookups([c, other]) == [c, other]
    bm.check_integrity()


# -- the loop on the hashing runner --------------------------------------------------------
def loop_for(policy: str, *, caching: bool, device: int, host: int, **options: object):
    return EngineLoop(
        runner=HashRunner(device, host, BLOCK, keep_sources=caching),
        policy=make_policy(
            policy, SchedulerConfig(max_num_batched_tokens=24, max_num_seqs=4), **options
        ),
        blocks=BlockManager(BLOCK, device, host, prefix_caching=caching),
        clock=VirtualClock(),
        max_model_len=128,
        decode=decode_chars,
    )


def run(loop: EngineLoop, requests: list[Request], stagger: int = 2) -> list[list[int]]:
    """Submit one request every ``stagger`` steps (later ones find earlier prefixes cached),
    checking the accounting after every step; outputs in submission order."""
    streams = []
    for r in requests:
        streams.append(loop.submit(r))
        for _ in range(stagger):
            loop.step()
            loop.blocks.check_integrity()
            check_lookups(loop)
    while loop.has_unfinished():
        loop.step()
        loop.blocks.check_integrity()
        check_lookups(loop)
    assert loop.blocks.all_free(), "blocks leaked"
    results = [s.result(timeout=0) for s in streams]  # type: ignore[union-attr]
    assert [r.error for r in results] == [None] * len(results)
    return [list(r.token_ids) for r in results]


POLICIES = [
    ("fcfs", {}),
    (
        "sj-mlfq",
        {"base_quantum": 1e-5, "starve_limit": 1e-3, "starve_check_every": 1, **MLFQ_ALWAYS},
    ),
    ("fair", {}),
    ("conserve", {"safepoints": False, "checkpoint_threshold": 1.0}),
    ("apt", {"cache": "kv"}),
]


@pytest.mark.parametrize(("policy", "options"), POLICIES, ids=[p for p, _ in POLICIES])
@pytest.mark.parametrize("host", [0, 24])
def test_outputs_are_the_same_with_and_without_the_cache_under_preemption(policy, options, host):
    """A pool too small for the batch forces swaps (host > 0) or recomputes; shared prompt
    prefixes make later requests start from cached blocks, some of them freed, swapped or
    evicted to the host in between."""

    def requests() -> list[Request]:
        return shared(8, 12, 5, max_tokens=10) + make_requests(3, prompt_len=9, max_tokens=6)

    plain = run(loop_for(policy, caching=False, device=512, host=0, **options), requests())
    loop = loop_for(policy, caching=True, device=14, host=host, **options)
    assert run(loop, requests()) == plain
    assert loop._applier.prefix_hits > 0


def test_hits_save_prefill_and_are_counted_in_tokens(make_loop):
    loop = make_loop(device=64, host=0, prefix_caching=True, max_num_batched_tokens=64)
    first, second = shared(2, 16, 3)
    run(loop, [first])
    computed_before = sum(len(s.token_ids) for so in loop.runner.steps for s in so.seqs)
    run(loop, [second])
    computed = sum(len(s.token_ids) for so in loop.runner.steps for s in so.seqs)
    assert computed - computed_before == 3 + 6 - 1  # its own 3 prompt tokens, then decodes
    stats = loop.stats()
    assert stats.prefix_cache_hits == 16 and stats.prefix_cache_queries == 2 * 19
    assert stats.device_cached_blocks >= 4


def test_a_reset_from_another_thread_is_done_by_the_loop_thread(make_loop):
    loop = make_loop(device=64, host=0, prefix_caching=True)
    first, second = shared(2, 16, 3)
    run(loop, [first])
    loop.start()
    assert loop.reset_prefix_cache(wait=True) == 6  # 24 tokens computed: 6 full blocks
    stream = loop.submit(second)
    assert stream is not None and stream.result(timeout=10).error is None
    loop.stop()
    assert loop.stats().prefix_cache_hits == 0
    assert loop.reset_prefix_cache() >= 6  # without a thread: at once, on the caller's


def test_a_pool_too_small_to_share_anything_behaves_like_no_cache():
    plain = run(loop_for("fcfs", caching=False, device=6, host=0), shared(4, 8, 2))
    assert run(loop_for("fcfs", caching=True, device=6, host=0), shared(4, 8, 2)) == plain


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["arrive", "cancel", "step"]),
            st.integers(0, 3),  # prefix group
            st.integers(1, 14),  # own tokens
        ),
        min_size=4,
        max_size=40,
    ),
    device=st.integers(8, 20),
    host=st.sampled_from([0, 3, 16]),
    policy=st.sampled_from(["fcfs", "sj-mlfq", "conserve"]),
)
def test_no_interleaving_of_shared_arrivals_evictions_and_frees_leaks_or_double_frees(
    ops, device, host, policy
):
    options = {"safepoints": False, "checkpoint_threshold": 1.0} if policy == "conserve" else {}
    loop = loop_for(policy, caching=True, device=device, host=host, **options)
    prefixes = [[(5 * g + 3 * j) % 41 + 2 for j in range(4 * g + 3)] for g in range(4)]
    live: list[str] = []
    for i, (op, group, own) in enumerate(ops):
        if op == "arrive":
            req = Request(
                f"q{i}",
                prefixes[group] + [(i + j) % 37 + 1 for j in range(own)],
                SamplingParams(max_tokens=1 + own % 5, ignore_eos=True),
                float(i),
                i,
            )
            loop.submit(req)
            live.append(req.request_id)
        elif op == "cancel" and live:
            loop.cancel(live.pop(group % len(live)))
        loop.step()
        loop.blocks.check_integrity()
        check_lookups(loop)
    loop.run_until_idle()
    loop.blocks.check_integrity()
    assert loop.blocks.all_free()


def test_a_hit_whose_host_blocks_a_swap_out_takes_is_cut_short_not_refused(monkeypatch):
    """A step that swaps one request out may take the host room a starting request's prefix
    hit reads from; the start keeps what the host can hold and computes the rest (it used to
    raise a PolicyError and fail every request in flight)."""
    trims = []
    trim_hit = BlockManager.trim_hit

    def spy(self: BlockManager, request_id: str, kept: int) -> int:
        trims.append((request_id, kept))
        return trim_hit(self, request_id, kept)

    monkeypatch.setattr(BlockManager, "trim_hit", spy)
    prefixes = [[(5 * g + 3 * j) % 41 + 2 for j in range(n)] for g, n in enumerate([14, 16, 14, 4])]
    # (prefix group, own tokens, max tokens) arriving, one step after each
    script = [(1, 5, 5), "step", "step", (0, 4, 9), (2, 14, 8), (1, 2, 9)]

    def play(loop: EngineLoop) -> dict[str, list[int]]:
        streams = {}
        for i, op in enumerate(script):
            if op != "step":
                group, own, max_tokens = op
                own_ids = [(i + j) % 37 + 1 for j in range(own)]
                params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
                req = Request(f"q{i}", prefixes[group] + own_ids, params, float(i), i)
                streams[req.request_id] = loop.submit(req)
            loop.step()
            loop.blocks.check_integrity()
        loop.run_until_idle()
        assert loop.blocks.all_free()
        results = {rid: s.result(timeout=0) for rid, s in streams.items()}  # type: ignore[union-attr]
        assert all(r.error is None for r in results.values())
        return {rid: list(r.token_ids) for rid, r in results.items()}

    options = dict(POLICIES)["sj-mlfq"]
    plain = play(loop_for("sj-mlfq", caching=False, device=512, host=0, **options))
    assert play(loop_for("sj-mlfq", caching=True, device=12, host=8, **options)) == plain
    assert trims, "the script no longer makes a swap-out take a hit's host room"


# -- the real engine -----------------------------------------------------------------------
ENGINE_POLICIES = [
    (
        "sj-mlfq",
        {"base_quantum": 1e-5, "starve_limit": 1e-3, "starve_check_every": 1, **MLFQ_ALWAYS},
    ),
    ("conserve", {"safepoints": False, "checkpoint_threshold": 1.0}),
    ("apt", {"cache": "hybrid"}),
]
# What each run must have done for the comparison to mean something.
ENGINE_EVENTS = {
    "sj-mlfq": lambda s: s.num_preemptions_swap > 0,
    "conserve": lambda s: s.num_checkpoint_blocks_copied > 0,
    "apt": lambda s: s.num_preemptions_recompute > 0,  # its cache switches
}


@pytest.mark.engine
@pytest.mark.parametrize(
    ("policy", "options"), ENGINE_POLICIES, ids=[p for p, _ in ENGINE_POLICIES]
)
def test_real_engine_greedy_tokens_are_the_same_with_and_without_the_cache(
    opt_tiny, policy, options
):
    """Shared-prefix prompts through a pool that forces swaps, recomputes, checkpoints or
    hidden-state caches (ConServe's offline class, Apt-Serve's hybrid cache)."""
    import quanta
    from quanta.core.request import RequestMetadata

    common = [(13 * j) % 400 + 4 for j in range(21)]
    prompts = [common + [(7 * i + j) % 300 + 9 for j in range(3 + i)] for i in range(6)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    meta = RequestMetadata(priority_class="offline")
    plain = quanta.LLM(str(opt_tiny), enable_prefix_caching=False)
    expected = [r.token_ids for r in plain.generate(prompts, params, metadata=meta)]
    cached = quanta.LLM(
        str(opt_tiny),
        policy=policy,
        policy_options=options,
        cache={"block_size": 4, "num_device_blocks": 24, "num_host_blocks": 12},
        scheduler={"max_num_seqs": 3, "max_num_batched_tokens": 16},
    )
    warm = cached.generate(prompts[:1], params, metadata=meta)  # later prompts find it cached
    got = cached.generate(prompts, params, metadata=meta)
    assert warm[0].token_ids == expected[0]
    assert [r.token_ids for r in got] == expected
    stats = cached.engine.loop.stats()
    assert stats.prefix_cache_hits >= 20 and ENGINE_EVENTS[policy](stats)
    cached.engine.loop.blocks.check_integrity()
    assert cached.engine.loop.blocks.all_free()


# -- cache affinity ------------------------------------------------------------------------
def test_affinity_puts_the_longest_cached_prefix_first_among_waiting_requests_only():
    from quanta.core.request import RequestStatus
    from quanta.policies.affinity import CacheAffinity
    from quanta.policies.stages import Ranking

    reqs = shared(5, 8, 2)
    reqs[0].status = RequestStatus.RUNNING
    for r, cached in zip(reqs[1:], [0, 4, 8, 4], strict=True):
        r.num_cached_tokens = cached
    ranking = Ranking(reqs, {r.request_id: float(i) for i, r in enumerate(reqs)})
    out = CacheAffinity(max_waiting=128, min_cached_tokens=1).reorder(ranking, None)  # type: ignore[arg-type]
    assert [r.request_id for r in out.order] == ["s0", "s3", "s2", "s4", "s1"]
    assert [out.next_turn[r.request_id] for r in out.order] == [0.0, 1.0, 2.0, 3.0, 4.0]
    few = CacheAffinity(max_waiting=3, min_cached_tokens=1).reorder(ranking, None)  # type: ignore[arg-type]
    assert few is ranking  # past the limit the system's order stands
    short = CacheAffinity(max_waiting=128, min_cached_tokens=5).reorder(ranking, None)  # type: ignore[arg-type]
    assert [r.request_id for r in short.order] == ["s0", "s3", "s1", "s2", "s4"]


@pytest.mark.parametrize("policy", ["fcfs+affinity", "sj-mlfq+affinity", "fair+affinity"])
def test_affinity_stacks_with_any_ordering_and_changes_no_output(policy):
    plain = run(loop_for(policy.split("+")[0], caching=True, device=64, host=0), shared(6, 12, 3))
    assert run(loop_for(policy, caching=True, device=64, host=0), shared(6, 12, 3)) == plain


def test_affinity_starts_a_cached_request_before_an_older_uncached_one(make_loop):
    loop = make_loop(device=64, host=0, prefix_caching=True, policy="fcfs+affinity", max_num_seqs=1)
    warm, twin = shared(2, 16, 3)
    run(loop, [warm])
    cold = make_requests(1, prompt_len=19)[0]
    before = len(loop.runner.steps)
    for r in (cold, twin):  # the cold one arrived first
        loop.submit(r)
    loop.run_until_idle()
    first = loop.runner.steps[before].seqs
    assert [s.request_id for s in first] == [twin.request_id]
