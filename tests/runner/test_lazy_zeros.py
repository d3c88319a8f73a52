"""KV pools in CPU memory are committed as they are written (``runner/lazy_zeros.py``): an
engine with the default 1 GiB + 2 GiB pools holds what it uses, not 3 GiB from the start, and
the pools still read as zeros."""

from __future__ import annotations

import os
from pathlib import Path

import quanta
import torch
from quanta.core.request import SamplingParams
from quanta.runner.lazy_zeros import zeros_on_demand

MiB = 1 << 20


def resident_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def test_a_region_is_zero_writable_aligned_and_committed_as_written() -> None:
    before = resident_bytes()
    t = zeros_on_demand((256, 1024, 1024), torch.bfloat16)  # 512 MiB
    assert t.shape == (256, 1024, 1024) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert t.data_ptr() % 4096 == 0
    assert resident_bytes() - before < 64 * MiB
    t[3] = 1.5
    assert float(t[3].sum()) == 1.5 * 1024 * 1024
    assert resident_bytes() - before < 64 * MiB  # one of 256 slices written: ~2 MiB
    assert int(t[:3].count_nonzero()) == 0 and int(t[4:].count_nonzero()) == 0


def test_a_forked_child_writes_its_own_copy() -> None:
    t = zeros_on_demand((4, 1024), torch.float32)
    pid = os.fork()
    if pid == 0:  # the child: a write must not reach the parent's pool
        t.fill_(7.0)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert int(t.count_nonzero()) == 0


def test_an_engine_holds_the_pool_it_uses_not_the_pool_it_sized(opt_tiny: Path) -> None:
    before = resident_bytes()
    llm = quanta.LLM(str(opt_tiny), cache={"device_bytes": 1 << 30, "host_bytes": 2 << 30})
    runner = llm.engine.runner
    pools = runner.device_kv_cache.nbytes + runner.host_kv_cache.nbytes
    assert pools > (2 << 30)
    (out,) = llm.generate(["hello"], SamplingParams(max_tokens=4, temperature=0.0))
    assert len(out.token_ids) == 4
    # the model, its workspace and a few written blocks: far below the 3 GiB sized
    assert resident_bytes() - before < 512 * MiB
    assert int(runner.host_kv_cache[:, :, :8].count_nonzero()) == 0
