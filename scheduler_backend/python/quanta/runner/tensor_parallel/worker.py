"""A tensor-parallel worker process: one rank's shard of the model and of every KV block,
running the steps rank 0 hands it and answering rank 0's collectives.

It decides nothing: the blocks, tokens and copies of each step come from rank 0, which got
them from the scheduler. It exits when rank 0 says stop or its pipe closes (rank 0 died), and
on any error of its own, after saying why: rank 0 then finds the group broken instead of
waiting in a collective.
"""

from __future__ import annotations

import datetime
import os
import sys
import traceback
from multiprocessing.connection import Client, Connection
from typing import Any

import torch
import torch.distributed as dist

from quanta.core.safepoint import StepAborted
from quanta.runner.models.safepoints import Safepoints
from quanta.runner.tensor_parallel.collectives import agree, serve_exchanges
from quanta.runner.tensor_parallel.group import AUTH_ENV, COLLECTIVE_TIMEOUT_S, WorkerStep
from quanta.runner.tensor_parallel.shard import Rank


def main(argv: list[str]) -> None:
    """``rank world init_method host:port``: call rank 0 back (the key is in the
    environment), take the runner's arguments, then serve."""
    rank, world, init_method, address = int(argv[0]), int(argv[1]), argv[2], argv[3]
    host, port = address.rsplit(":", 1)
    conn = Client((host, int(port)), authkey=bytes.fromhex(os.environ[AUTH_ENV]))
    conn.send(rank)
    runner_args, threads = conn.recv()
    worker_main(rank, world, init_method, conn, runner_args, threads)


def worker_main(
    rank: int,
    world: int,
    init_method: str,
    conn: Connection,
    runner_args: dict[str, Any],
    threads: int,
) -> None:
    """Load the shard, say ready, join the group, then serve steps until told to stop."""
    from quanta.runner.model_runner import ModelRunner

    torch.set_num_threads(threads)
    try:
        runner = ModelRunner(**runner_args, tensor_rank=Rank(rank, world))
    except Exception as exc:  # said to rank 0, which raises it
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", None))
    dist.init_process_group(
        "gloo",
        init_method=init_method,
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # rank 0 is gone
            break
        if message[0] == "stop":
            break
        try:
            if message[0] == "step":
                aborted = run_step(runner, message[1])
            else:
                forward_logits(runner, message[1], message[2])
                aborted = False
            conn.send(("done", aborted))
        except Exception as exc:  # rank 0 waits in a collective: say why, then go
            conn.send(("failed", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
            os._exit(1)
    dist.destroy_process_group()


def _safepoints(runner: Any) -> Safepoints:
    def check(layers_done: int) -> None:
        if agree(False):
            raise StepAborted(layers_done, 0.0)

    return Safepoints(runner.safepoint_interval, check)


def run_step(runner: Any, step: WorkerStep) -> bool:
    """This rank's share of one step, in rank 0's order: swap copies, the forward pass, the
    LM head exchanges, checkpoint copies. Returns whether it stopped at a safepoint."""
    from quanta.runner.model_runner import _Chunk

    seqs = [_Chunk(*seq) for seq in step.seqs]
    aborted = False
    with torch.inference_mode():
        batch = runner._prepare(seqs, runner.num_device_blocks) if seqs else None
        runner._copy_blocks(step.swap_out, runner.device_kv_cache, runner.host_kv_cache)
        runner._copy_blocks(step.swap_in, runner.host_kv_cache, runner.device_kv_cache)
        if batch is not None:
            safepoints = _safepoints(runner) if step.preemptible else None
            try:
                runner.model(
                    batch.input_ids, batch.positions, runner.device_kv_cache, batch.meta, safepoints
                )
            except StepAborted:
                aborted = True
        _serve(runner)
        if not aborted:
            runner._copy_blocks(step.checkpoint, runner.device_kv_cache, runner.host_kv_cache)
    return aborted


def forward_logits(runner: Any, token_ids: list[int], chunk_size: int | None) -> None:
    """This rank's share of ``ModelRunner.forward_logits`` (a test helper)."""
    from quanta.runner.model_runner import _Chunk

    num_blocks = -(-len(token_ids) // runner.block_size)
    cache = runner._allocate_kv(num_blocks, runner.device)
    table = tuple(reversed(range(num_blocks)))
    step = chunk_size or len(token_ids)
    with torch.inference_mode():
        for start in range(0, len(token_ids), step):
            chunk = _Chunk(
                tuple(token_ids[start : start + step]), start, table, False, len(token_ids)
            )
            batch = runner._prepare([chunk], num_blocks)
            runner.model(batch.input_ids, batch.positions, cache, batch.meta)
            _serve(runner)
        _serve(runner)


def _serve(runner: Any) -> None:
    head = runner.model.lm_head
    serve_exchanges(head.local, head.weight.shape[1], runner.dtype)


if __name__ == "__main__":
    main(sys.argv[1:])
