"""Tensor parallelism on ``torch.distributed``: one model and its KV cache split over ranks.

``shard`` cuts a loaded model (Megatron-style), ``group`` runs the worker processes from the
engine's process (rank 0), ``worker`` is one worker, and ``collectives`` holds what the ranks
exchange beyond the forward pass's all-reduces. The scheduler never sees ranks: a block id
names the same block on every rank, each holding its heads' share of it.
"""

from __future__ import annotations

from typing import Any

import torch

from quanta.core.output import SchedulerOutput
from quanta.runner.models.config import ModelConfig
from quanta.runner.tensor_parallel.collectives import (
    agree,
    end_exchanges,
    exchange_rows,
    gather_columns,
)
from quanta.runner.tensor_parallel.group import WorkerGroup, WorkerStep, per_rank_threads
from quanta.runner.tensor_parallel.shard import (
    Rank,
    check_divisible,
    shard_model,
    wrap_row_parallel,
)


def check_tensor_parallel(
    config: ModelConfig, world: int, device: torch.device, draft_model: object
) -> None:
    """Refuse what tensor parallelism does not run, before any worker starts."""
    check_divisible(config, world)
    if device.type != "cpu":
        # NOTE: NCCL needs one GPU per rank; the machines this was built on have one.
        raise ValueError(
            f"tensor parallelism runs on CPU (gloo) here; {device.type} ranks (NCCL) are "
            "not built yet"
        )
    if draft_model is not None:
        raise ValueError(
            "speculative decoding with a draft model does not run with tensor parallelism"
        )


def start_workers(world: int, **runner_args: Any) -> WorkerGroup:
    """Ranks 1..world-1 of a runner built with ``runner_args``, started: the cores are
    split between the ranks (this process takes its share too), and each worker begins
    loading its shard. ``WorkerGroup.connect`` waits for them."""
    threads = per_rank_threads(world)
    torch.set_num_threads(threads)
    group = WorkerGroup(world, runner_args, threads)
    group.spawn()
    return group


def worker_step(so: SchedulerOutput) -> WorkerStep:
    """What the workers need of a step (no sampling state, no signal: they cannot pickle and
    only rank 0 uses them)."""
    return WorkerStep(
        seqs=tuple(
            (s.token_ids, s.start_pos, s.block_table, s.hidden, s.num_prompt_tokens)
            for s in so.seqs
        ),
        swap_out=so.swap_out,
        swap_in=so.swap_in,
        checkpoint=so.checkpoint,
        preemptible=so.abort is not None,
    )


__all__ = [
    "Rank",
    "WorkerGroup",
    "WorkerStep",
    "agree",
    "check_tensor_parallel",
    "end_exchanges",
    "exchange_rows",
    "gather_columns",
    "shard_model",
    "start_workers",
    "worker_step",
    "wrap_row_parallel",
]
