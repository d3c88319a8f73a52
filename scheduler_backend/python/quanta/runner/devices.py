"""How much memory a device has, for sizing KV tiers and refusing sizes that cannot fit."""

from __future__ import annotations

import gc
import os


def device_memory_bytes(device: str) -> int:
    """Total memory of ``device``: physical RAM for CPU, the GPU's memory for CUDA."""
    if device.startswith("cuda"):
        import torch

        return int(torch.cuda.get_device_properties(torch.device(device)).total_memory)
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class CudaMemory:
    """A CUDA device's memory as the KV sizing reads it (``quanta.runner.memory``):
    ``torch.cuda.mem_get_info`` for the device as a whole, the caching allocator's
    statistics for this process's peak."""

    def __init__(self, device: str) -> None:
        import torch

        self._torch = torch
        self.device = torch.device(device)
        self._base = 0

    def total(self) -> int:
        return int(self._torch.cuda.mem_get_info(self.device)[1])

    def free(self) -> int:
        cuda = self._torch.cuda
        gc.collect()  # tensors of dropped engines, so their blocks can go back
        cuda.synchronize(self.device)
        cuda.empty_cache()
        return int(cuda.mem_get_info(self.device)[0])

    def start_peak(self) -> None:
        cuda = self._torch.cuda
        cuda.synchronize(self.device)
        cuda.reset_peak_memory_stats(self.device)
        self._base = int(cuda.memory_allocated(self.device))

    def peak(self) -> int:
        cuda = self._torch.cuda
        cuda.synchronize(self.device)
        return int(cuda.max_memory_allocated(self.device)) - self._base
