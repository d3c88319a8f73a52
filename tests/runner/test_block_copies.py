"""Block copies between the device and host tiers (``quanta.runner.block_copies``): the host
tier is moved in runs of consecutive blocks, the device tier by indexed copies. On the CPU
the same copies run in line; on CUDA on a side stream (``tests/runner/test_cuda.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from quanta.runner import ModelRunner
from quanta.runner.block_copies import runs


def test_runs_split_where_the_host_blocks_stop_being_consecutive() -> None:
    assert list(runs([5, 0, 1, 2, 9, 10, 4])) == [(0, 5, 1), (1, 0, 3), (4, 9, 2), (6, 4, 1)]
    assert list(runs([3])) == [(0, 3, 1)]


@pytest.mark.engine
def test_a_swap_round_trip_through_runs_and_single_blocks_restores_every_layer(
    opt_tiny: Path,
) -> None:
    runner = ModelRunner(
        opt_tiny, num_device_blocks=16, num_host_blocks=12, block_size=4, dtype="float32"
    )
    device, host = runner.device_kv_cache, runner.host_kv_cache
    device.copy_(torch.randn(device.shape, generator=torch.Generator().manual_seed(0)))
    out = ((3, 5), (7, 0), (8, 1), (9, 2), (12, 9), (1, 10))
    want = device[:, :, [d for d, _ in out]].clone()
    runner._copy_blocks(out, device, host)
    assert torch.equal(host[:, :, [h for _, h in out]], want)
    assert int(host[:, :, [3, 4, 6, 7, 8, 11]].count_nonzero()) == 0  # nothing else written
    back = ((5, 15), (0, 3), (1, 4), (2, 0), (9, 7), (10, 8))
    runner._copy_blocks(back, host, device)
    assert torch.equal(device[:, :, [d for _, d in back]], want)


@pytest.mark.engine
def test_copies_name_the_runners_own_tiers(opt_tiny: Path) -> None:
    runner = ModelRunner(opt_tiny, num_device_blocks=4, num_host_blocks=4, dtype="float32")
    with pytest.raises(ValueError, match="between the device and the host tier"):
        runner._copy_blocks(((0, 1),), runner.device_kv_cache, runner.device_kv_cache.clone())
