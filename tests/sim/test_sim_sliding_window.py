"""The simulator with a sliding-window profile: its block manager gives blocks behind the
window back, as the engine's does, so long generations fit a pool that full attention would
have to preempt from."""

from __future__ import annotations

from quanta.costmodel import PROFILES
from quanta.sim import SimSetup, simulate
from quanta.workloads import WorkloadRequest

FULL = PROFILES["a100-llama7b"]
WINDOWED = FULL.model_copy(update={"sliding_window": 256})


def test_long_generations_fit_a_small_pool_only_with_a_window() -> None:
    trace = [WorkloadRequest(0.01 * i, 300, 1500, f"r{i}") for i in range(4)]
    # 4 x (300 + 1500) tokens are 450 blocks of 16; with the window each holds at most 17
    setup = dict(policy="fcfs", block_size=16, num_device_blocks=160, num_host_blocks=0)
    windowed = simulate(trace, SimSetup(profile=WINDOWED, **setup))  # type: ignore[arg-type]
    full = simulate(trace, SimSetup(profile=FULL, **setup))  # type: ignore[arg-type]
    assert all(r.status.finished for r in windowed.requests + full.requests)
    assert windowed.loop.num_preemptions_recompute == 0
    assert full.loop.num_preemptions_recompute > 0
