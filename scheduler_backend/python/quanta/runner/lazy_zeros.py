"""KV pools in CPU memory that cost only what is written to them.

An engine's pools are sized up front (1 GiB of device blocks and 2 GiB of host blocks by
default) but a server's traffic may touch a fraction of them, and the host tier is written
only when something is swapped out or checkpointed. ``torch.zeros`` writes every byte, so
each engine held its full 3 GiB from the start: a few engines or servers side by side on a
24 GiB machine ran it out of memory. A private anonymous mapping is zero by the kernel's
contract and committed page by page as it is first written, so the pools still read as zeros
everywhere and their resident size follows their use.
"""

from __future__ import annotations

import math
import mmap

import torch


def zeros_on_demand(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled, writable CPU tensor of ``shape`` whose pages are committed when first
    written (page aligned, private to this process: a forked child gets a copy on write)."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # NOTE: the tensor keeps ``region`` alive; it is unmapped when the last view is freed
    return torch.frombuffer(region, dtype=torch.uint8).view(dtype).view(shape)
