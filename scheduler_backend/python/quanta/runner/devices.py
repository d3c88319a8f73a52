"""How much memory a device has, for sizing KV tiers and refusing sizes that cannot fit."""

from __future__ import annotations

import os


def device_memory_bytes(device: str) -> int:
    """Total memory of ``device``: physical RAM for CPU, the GPU's memory for CUDA."""
    if device.startswith("cuda"):
        import torch

        return int(torch.cuda.get_device_properties(torch.device(device)).total_memory)
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
