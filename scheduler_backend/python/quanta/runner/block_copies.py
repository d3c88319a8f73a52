"""Block copies between a runner's device and host KV tiers: swaps out and in (FastServe's
proactive swap, reactive preemption) and incremental checkpoints (ConServe).

The device tier is read and written by indexed copies (kernels on CUDA); the host tier only by
copies of runs of consecutive blocks (for each layer, K and V, a run is contiguous): on CUDA
the CPU must never read or write pinned memory that a queued copy may still be using, and
contiguous runs are what ``non_blocking`` copies to and from pinned memory move without the
host waiting.

On CUDA the copies run on a side stream: it first waits for the work queued on the compute
stream (the forward that wrote the blocks a swap-out or checkpoint reads, or still reads the
blocks a swap-in overwrites), and the compute stream then waits for the copies by an event, so
the next forward reads swapped-in blocks complete and reuses a swapped-out block only once it
has been read. The host waits for neither. Copies on the one side stream keep their order, so
a block a swap-out frees can be the target of the swap-in after it, and a host block is read
and rewritten in the order the steps asked. On the CPU the stream is no stream and the same
copies run in line.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


def check_copies(pairs: tuple[tuple[int, int], ...], num_src: int, num_dst: int) -> None:
    """Raise ValueError for a pair outside its tier, before anything is copied."""
    for src_id, dst_id in pairs:
        if not (0 <= src_id < num_src and 0 <= dst_id < num_dst):
            raise ValueError(
                f"block copy {src_id} -> {dst_id} is out of range "
                f"({num_src} source, {num_dst} target blocks)"
            )


class BlockCopies:
    """Copies blocks between one device tier and one host tier; where they run: a side stream
    on CUDA, in line on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def copy(
        self,
        pairs: tuple[tuple[int, int], ...],
        src: torch.Tensor,
        dst: torch.Tensor,
        host_kv: torch.Tensor,
    ) -> None:
        """Copy blocks ``src_id -> dst_id`` for all layers, K and V; ``src`` and ``dst`` are
        the device tier and ``host_kv``, either way round."""
        if not pairs:
            return
        to_host = dst is host_kv
        if not to_host and src is not host_kv:
            raise ValueError("block copies run between the device and the host tier")
        device_kv = src if to_host else dst
        host_rows = host_kv.flatten(0, 1)  # [layers * 2, blocks, ...]
        with self.run():
            device_ids = self._index([s if to_host else d for s, d in pairs], device_kv)
            if to_host:
                moved = device_kv.index_select(2, device_ids).flatten(0, 1)
            else:
                shape = (*host_rows.shape[:1], len(pairs), *host_rows.shape[2:])
                moved = torch.empty(shape, dtype=dst.dtype, device=dst.device)
            for first, host_first, n in runs([d if to_host else s for s, d in pairs]):
                for row in range(host_rows.shape[0]):
                    host = host_rows[row, host_first : host_first + n]
                    there = moved[row, first : first + n]
                    if to_host:
                        host.copy_(there, non_blocking=True)
                    else:
                        there.copy_(host, non_blocking=True)
            if not to_host:
                device_kv.index_copy_(2, device_ids, moved.unflatten(0, device_kv.shape[:2]))

    @contextlib.contextmanager
    def run(self) -> Iterator[None]:
        """The copies queued inside run on the side stream, ordered after the compute stream's
        work and before what it queues next (no-op on the CPU)."""
        if self.stream is None:
            yield
            return
        compute = torch.cuda.current_stream(self.stream.device)
        self.stream.wait_stream(compute)
        with torch.cuda.stream(self.stream):
            yield
        compute.wait_event(self.stream.record_event())

    def _index(self, ids: list[int], like: torch.Tensor) -> torch.Tensor:
        """``ids`` as an index tensor on ``like``'s device; on CUDA through pinned memory,
        so the upload is queued on the side stream rather than waited for."""
        pin = self.stream is not None
        index = torch.tensor(ids, dtype=torch.long, pin_memory=pin)
        return index.to(like.device, non_blocking=True)


def runs(host_ids: list[int]) -> Iterator[tuple[int, int, int]]:
    """``(first pair, first host block, length)`` of each run of consecutive host blocks in
    the order the pairs name them."""
    first = 0
    for i in range(1, len(host_ids) + 1):
        if i == len(host_ids) or host_ids[i] != host_ids[i - 1] + 1:
            yield first, host_ids[first], i - first
            first = i
