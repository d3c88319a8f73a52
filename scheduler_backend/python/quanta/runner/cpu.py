"""What this CPU can run, read once from the kernel's flags: machines differ (one has AMX,
the next only AVX2), and the engine's defaults and logs must say which path ran here."""

from __future__ import annotations

import ctypes
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


# glibc's mallopt parameters, and the values the engine sets (see ``keep_freed_memory``).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_TRIM_THRESHOLD = 1 << 30
_MMAP_THRESHOLD = 256 << 20


@functools.cache
def keep_freed_memory() -> bool:
    """Make glibc's malloc keep freed memory for reuse instead of returning it to the OS.

    Why: each step allocates and frees tens of MB of temporaries (gathered K/V, activations).
    By default glibc serves blocks that large with fresh mmaps, or trims the heap after they
    are freed, so every step page-faults its temporaries back in: measured here, that made a
    batch-32 decode step of OPT-125M 2.5x slower (430 ms against 170 ms), depending on heap
    layout. vLLM's CPU backend gets the same effect by preloading tcmalloc. Returns whether
    the settings took (False off glibc)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        trim = libc.mallopt(_M_TRIM_THRESHOLD, ctypes.c_int(_TRIM_THRESHOLD))
        mmap = libc.mallopt(_M_MMAP_THRESHOLD, ctypes.c_int(_MMAP_THRESHOLD))
    except (OSError, AttributeError):
        return False
    return bool(trim and mmap)
