"""What this CPU can run, read once from the kernel's flags: machines differ (one has AMX,
the next only AVX2), and the engine's defaults and logs must say which path ran here."""

from __future__ import annotations

import functools
import platform
from pathlib import Path

# Most capable first: the first one present names the path oneDNN takes.
_ISAS = ("amx_bf16", "avx512_bf16", "avx512f", "avx2")


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (Linux ``/proc/cpuinfo``); empty where it cannot be read."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def cpu_isa() -> str:
    """The best matrix instruction set present: amx_bf16, avx512_bf16, avx512f, avx2, or the
    machine's name when none of them is (e.g. aarch64)."""
    flags = cpu_flags()
    return next((isa for isa in _ISAS if isa in flags), platform.machine() or "unknown")


def has_fast_bf16() -> bool:
    """Whether bf16 GEMMs run natively (AMX or AVX512_BF16) rather than emulated."""
    return bool({"amx_bf16", "avx512_bf16"} & cpu_flags())
