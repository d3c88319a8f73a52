"""Sliding-window release: a windowed sequence's blocks that no layer's window reaches go back
to the pool, every block path skips them, and the tokens do not change.

The fake runner here reads only each token's window through the block table, so a released
block read shows as an assertion, and free blocks are wiped after every step, so a stale read
changes the tokens."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fakes import HashRunner, decode_chars
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from quanta.core.block_pool import Tier
from quanta.core.blocks import BlockManager
from quanta.core.clock import VirtualClock
from quanta.core.config import SchedulerConfig
from quanta.core.loop import EngineLoop
from quanta.core.output import RunnerOutput, SchedulerOutput
from quanta.core.request import Request, RequestMetadata, SamplingParams
from quanta.core.window import RELEASED, blocks_behind, kv_window, live, peak_blocks
from quanta.costmodel import CostModel, get_profile
from quanta.policies import make_policy

WINDOW, BLOCK = 16, 4


class WindowHashRunner(HashRunner):
    """A ``HashRunner`` whose tokens hash only the last ``window`` tokens of their context, as
    a model whose every layer slides; reading a released entry fails."""

    def __init__(self, device: int, host: int, block_size: int, window: int) -> None:
        super().__init__(device, host, block_size, keep_sources=True)
        self.window = window
        self.reads: list[int] = []  # every block id read

    def execute(self, so: SchedulerOutput) -> RunnerOutput:
        self.steps.append(so)
        for d, h in so.swap_out:
            self.host[h] = list(self.device[d])
        for h, d in so.swap_in:
            self.device[d] = list(self.host[h])
        sampled: list[int | None] = []
        bs = self.block_size
        for s in so.seqs:
            assert not s.num_draft_tokens
            for i, tok in enumerate(s.token_ids):
                pos = s.start_pos + i
                block = s.block_table[pos // bs]
                assert block != RELEASED, f"{s.request_id} wrote into a released block"
                self.device[block][pos % bs] = tok
            if not s.sample:
                sampled.append(None)
                continue
            first = max(0, s.context_len - self.window)
            ctx = []
            for p in range(first, s.context_len):
                block = s.block_table[p // bs]
                assert block != RELEASED, f"{s.request_id} read position {p}, released"
                self.reads.append(block)
                ctx.append(self.device[block][p % bs])
            assert -1 not in ctx, f"{s.request_id} read a wiped slot"
            sampled.append(self._next(ctx, s))
        for d, h in so.checkpoint:
            self.host[h] = list(self.device[d])
        return RunnerOutput(tuple(s.request_id for s in so.seqs), tuple(sampled))

    def wipe(self, blocks: BlockManager) -> None:
        """Forget what the free blocks hold (named ones stay: the prefix cache reads them)."""
        for tier, store in ((Tier.DEVICE, self.device), (Tier.HOST, self.host)):
            pool = blocks.pools[tier]
            for b in pool.free_ids():
                if b not in pool.name_of:
                    store[b] = [-1] * self.block_size


def _loop(
    *,
    release: bool,
    device: int = 64,
    host: int = 64,
    prefix_caching: bool = False,
    policy: str = "fcfs",
    window: int = WINDOW,
    block_size: int = BLOCK,
    budget: int = 32,
    **options: object,
) -> EngineLoop:
    return EngineLoop(
        runner=WindowHashRunner(device, host, block_size, window),
        policy=make_policy(policy, SchedulerConfig(max_num_batched_tokens=budget), **options),
        blocks=BlockManager(
            block_size,
            device,
            host,
            prefix_caching=prefix_caching,
            sliding_window=window if release else 0,
        ),
        clock=VirtualClock(),
        max_model_len=512,
        decode=decode_chars,
    )


def _requests(lengths: list[int], max_tokens: int, shared: int = 0) -> list[Request]:
    """Prompts whose first ``shared`` tokens are the same (a prefix to cache)."""
    return [
        Request(
            request_id=f"r{i}",
            prompt_token_ids=[
                (3 * j) % 47 + 1 if j < shared else (7 * i + j) % 50 for j in range(n)
            ],
            params=SamplingParams(max_tokens=max_tokens),
            arrival_time=i * 1e-3,
            seed=i,
        )
        for i, n in enumerate(lengths)
    ]


def _steps(loop: EngineLoop, requests: list[Request]) -> Iterator[None]:
    """Submit ``requests``, then step until idle, wiping free blocks and checking the books
    after each step."""
    for r in requests:
        loop.submit(r)
    runner = loop.runner
    assert isinstance(runner, WindowHashRunner)
    while loop.has_unfinished():
        loop.step()
        loop.blocks.check_integrity()
        runner.wipe(loop.blocks)
        yield


def _serve(loop: EngineLoop, requests: list[Request]) -> dict[str, list[int]]:
    for _ in _steps(loop, requests):
        pass
    loop.blocks.check_integrity()
    assert loop.blocks.all_free(), "blocks leaked"
    return {r.request_id: list(r.output_token_ids) for r in requests}


def test_the_window_every_layer_reads_within_is_what_releases() -> None:
    assert kv_window((16, 16, 16)) == 16  # Mistral: every layer slides
    assert kv_window((16, 0, 16, 0)) == 0  # Gemma 2: global layers read everything
    assert kv_window(()) == 0
    assert blocks_behind(40, 16, 4) == 6  # positions 0..23 are older than 40 - 16
    assert blocks_behind(16, 16, 4) == 0
    assert peak_blocks(1000, 16, 4) == 5 and peak_blocks(10, 16, 4) == 3
    assert peak_blocks(1000, 0, 4) == 250


def test_blocks_go_back_to_the_pool_as_a_long_sequence_advances() -> None:
    loop = _loop(release=True, budget=16)
    (r,) = _requests([40], max_tokens=80)
    bm = loop.blocks
    most = 0
    for _ in _steps(loop, [r]):
        if r.status.finished:
            break
        held = bm.num_blocks(r.request_id)
        most = max(most, held)
        # NOTE: once a step is committed: the window's blocks and the one it ends in
        assert held <= WINDOW // BLOCK + 1
        assert bm.num_free(Tier.DEVICE) == bm.num_total(Tier.DEVICE) - held
        assert bm.table_length(r.request_id) == -(-r.num_computed_tokens // BLOCK)
    assert r.num_output_tokens == 80
    assert most == WINDOW // BLOCK + 1  # of the 30 blocks its 120 tokens span
    assert bm.all_free()


def test_tokens_are_those_of_the_same_run_without_release() -> None:
    requests = lambda: _requests([40, 23, 57], max_tokens=50)  # noqa: E731
    kept = _serve(_loop(release=False), requests())
    loop = _loop(release=True)
    assert _serve(loop, requests()) == kept
    runner = loop.runner
    assert isinstance(runner, WindowHashRunner)
    assert runner.reads  # the runner read windows, never a released entry (it asserts)


@pytest.mark.parametrize(
    ("device", "host", "mode"),
    [(14, 64, "swap"), (14, 0, "recompute")],
)
def test_tokens_hold_under_preemption(device: int, host: int, mode: str) -> None:
    requests = lambda: _requests([30, 26, 34, 20], max_tokens=40)  # noqa: E731
    expected = _serve(_loop(release=False), requests())
    loop = _loop(release=True, device=device, host=host)
    assert _serve(loop, requests()) == expected
    stats = loop.stats()
    preempted = stats.num_preemptions_swap if mode == "swap" else stats.num_preemptions_recompute
    assert preempted > 0


def test_tokens_hold_with_prefix_caching_and_released_blocks_stay_cached() -> None:
    requests = lambda: _requests([40, 44, 36], max_tokens=30, shared=32)  # noqa: E731
    expected = _serve(_loop(release=False), requests())
    loop = _loop(release=True, prefix_caching=True, device=24)
    first, *rest = requests()
    assert _serve(loop, [first]) == {"r0": expected["r0"]}
    assert loop.blocks.num_cached(Tier.DEVICE) >= 8  # released while it ran, named, free
    assert _serve(loop, rest) == {k: v for k, v in expected.items() if k != "r0"}
    assert loop.stats().prefix_cache_hits > 0


def test_checkpointed_requests_skip_released_blocks() -> None:
    def requests() -> tuple[list[Request], list[Request]]:
        offline = _requests([30, 26, 34, 20], max_tokens=40)
        for r in offline:
            r.metadata = RequestMetadata(priority_class="offline")
        online = _requests([12, 10], max_tokens=20)
        for r in online:
            r.request_id = "on" + r.request_id
        return offline, online

    def serve(loop: EngineLoop) -> dict[str, list[int]]:
        offline, online = requests()
        steps = _steps(loop, offline)
        for _ in range(6):
            next(steps)
        for r in online:
            loop.submit(r)
        for _ in steps:
            pass
        assert loop.blocks.all_free()
        return {r.request_id: list(r.output_token_ids) for r in offline + online}

    expected = serve(_loop(release=False))
    loop = _loop(
        release=True,
        device=16,
        policy="conserve",
        safepoints=False,
        checkpoint_threshold=1.0,
        prefetch=False,
    )
    assert serve(loop) == expected
    stats = loop.stats()
    assert stats.num_checkpoint_blocks_copied > 0 and stats.num_preemptions_checkpoint > 0


def test_a_model_with_one_global_layer_releases_nothing() -> None:
    gemma2 = kv_window((WINDOW, 0) * 2)  # local and global layers alternate
    assert gemma2 == 0
    loop = _loop(release=bool(gemma2))
    (r,) = _requests([40], max_tokens=40)
    for _ in _steps(loop, [r]):
        if not r.status.finished:
            table = loop.blocks.block_table(r.request_id)
            assert RELEASED not in table and len(live(table)) == len(table)


def test_admission_counts_a_windowed_sequence_at_its_window() -> None:
    loop = _loop(release=True, device=8)
    (r,) = _requests([20], max_tokens=400)  # 105 blocks in all, 5 at most at once
    loop.validate(r)
    with pytest.raises(Exception, match="could never complete"):
        _loop(release=False, device=8).validate(r)


def test_the_cost_model_caps_a_windowed_sequence() -> None:
    full = get_profile("a100-llama7b")
    windowed = full.model_copy(update={"sliding_window": 4096})
    assert isinstance(windowed, CostModel)
    assert full.kv_blocks(32768, 16) == 2048
    assert windowed.kv_blocks(32768, 16) == 4096 // 16 + 1
    assert windowed.kv_blocks(1000, 16) == full.kv_blocks(1000, 16)
    # a decode past the window reads the window, not the whole context
    assert windowed.decode_time(8, 8 * 32768) == pytest.approx(windowed.decode_time(8, 8 * 4097))
    assert windowed.decode_time(8, 8 * 32768) < full.decode_time(8, 8 * 32768)
    assert windowed.prefill_time(512, 2048) == full.prefill_time(512, 2048)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=4),
    max_tokens=st.integers(1, 40),
    window=st.integers(1, 24),
    block_size=st.sampled_from([1, 2, 4, 8]),
    device=st.integers(0, 16),
    host=st.sampled_from([0, 64]),
)
def test_any_run_holds_at_most_the_cap_and_never_reads_a_released_block(
    lengths: list[int], max_tokens: int, window: int, block_size: int, device: int, host: int
) -> None:
    budget = 8
    need = max(-(-n // block_size) for n in lengths) + peak_blocks(
        window + budget, window, block_size
    )
    device += need  # every request fits alone
    expected = _serve(
        _loop(release=False, window=window, block_size=block_size, device=512, budget=budget),
        _requests(lengths, max_tokens),
    )
    loop = _loop(
        release=True, window=window, block_size=block_size, device=device, host=host, budget=budget
    )
    requests = _requests(lengths, max_tokens)
    cap = -(-window // block_size) + 1  # once a step is committed: the window's and one
    for _ in _steps(loop, requests):
        for r in requests:
            assert loop.blocks.num_blocks(r.request_id) <= cap
    assert {r.request_id: list(r.output_token_ids) for r in requests} == expected
    assert loop.blocks.all_free()
