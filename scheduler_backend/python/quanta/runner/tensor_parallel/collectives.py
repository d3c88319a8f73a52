"""The collectives every rank issues in the same order during a step, beyond the forward
pass's all-reduces: the LM head's row exchange and the safepoints' agreement.

Rank 0 (the driver) alone knows which rows it samples and whether the scheduler's abort
signal is raised; these calls carry that to the workers, which answer in lockstep.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

_END = -1  # a row count that ends a step's exchanges


def exchange_rows(
    hidden: torch.Tensor, local: Callable[[torch.Tensor], torch.Tensor], world: int
) -> torch.Tensor:
    """Rank 0: send ``hidden`` rows to every rank, compute this rank's vocabulary columns
    with ``local`` and gather all of them, in rank order: ``[rows, world * shard]``."""
    rows = hidden.contiguous()
    dist.broadcast(torch.tensor([rows.shape[0]], dtype=torch.long), 0)
    dist.broadcast(rows, 0)
    mine = local(rows).contiguous()
    parts = [torch.empty_like(mine) for _ in range(world)]
    dist.gather(mine, parts, dst=0)
    return torch.cat(parts, dim=1)


def end_exchanges() -> None:
    """Rank 0: the step asks for no more logits."""
    dist.broadcast(torch.tensor([_END], dtype=torch.long), 0)


def serve_exchanges(
    local: Callable[[torch.Tensor], torch.Tensor], width: int, dtype: torch.dtype
) -> None:
    """A worker: answer rank 0's ``exchange_rows`` until ``end_exchanges``."""
    count = torch.empty(1, dtype=torch.long)
    while True:
        dist.broadcast(count, 0)
        n = int(count.item())
        if n == _END:
            return
        rows = torch.empty(n, width, dtype=dtype)
        dist.broadcast(rows, 0)
        dist.gather(local(rows).contiguous(), dst=0)


def agree(raised: bool) -> bool:
    """Whether any rank says stop (only rank 0 ever does): every rank stops at the same
    safepoint, or the next all-reduce would pair ranks at different layers."""
    flag = torch.tensor([1 if raised else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def gather_columns(part: torch.Tensor) -> torch.Tensor:
    """Every rank's ``[rows, width]`` columns side by side, in rank order (the hidden
    cache's stored states: each rank keeps its own columns)."""
    part = part.contiguous()
    parts = [torch.empty_like(part) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, part)
    return torch.cat(parts, dim=1)
