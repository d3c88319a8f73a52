"""Copies between the host and the device that never make the host wait for the device.

On CUDA a plain ``torch.tensor(values, device="cuda")`` or ``.tolist()`` synchronizes the
stream, so the host waits for every kernel queued before it (the whole forward pass). These
copies go through pinned host memory with ``non_blocking=True`` instead, and the way back
records an event that only the reader of the result waits on. On a CPU device both are plain
tensors and cost nothing extra.

Pinned buffers come from torch's caching host allocator (``Tensor.pin_memory``,
``torch.empty(..., pin_memory=True)``), which keeps a block from reuse until the copies that
read or write it have run, so nothing here has to hold a buffer alive by hand.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(
    values: Sequence[int] | Sequence[float], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """``values`` as a tensor on ``device``, copied without waiting for the device."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype).pin_memory().to(device, non_blocking=True)


class HostCopies:
    """Device tensors on their way to the host: the copies are queued on the current stream
    behind the work that computes them, and ``wait`` blocks until they have landed."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self._event: torch.cuda.Event | None = None
        if not any(t.device.type == "cuda" for t in tensors):
            self._host = list(tensors)
            return
        self._host = []
        for t in tensors:
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.copy_(t, non_blocking=True)
            self._host.append(host)
        self._event = torch.cuda.Event()
        self._event.record()

    def ready(self) -> bool:
        """Whether ``wait`` would return at once."""
        return self._event is None or self._event.query()

    def wait(self) -> list[torch.Tensor]:
        """The host tensors, once the copies have landed (at once on a CPU device)."""
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        return self._host
