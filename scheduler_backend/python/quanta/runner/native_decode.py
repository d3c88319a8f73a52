"""The native decode-attention kernel (``paged_decode.c``): built once per machine with its C
compiler, loaded through ctypes, called once per layer of a decode step.

It reads each row's slots in place from the paged cache, so a decode step pays neither the
gather of SDPA row by row nor Dynamo's guards of the compiled kernel (measured in
``docs/results/benchmarks.md``). Where no C compiler is found, or the build fails, ``load`` returns
None and the engine falls back to the compiled or eager kernel with a warning: slower, never
broken.

The shared object lives in ``QUANTA_KERNEL_CACHE`` (default ``~/.cache/quanta/kernels``),
named by the hash of the source, the flags, the compiler and this CPU's feature flags, so a
change to any of them builds anew, and a home directory shared by different CPUs never loads
a build made for another's instruction set.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from quanta.runner.cpu import cpu_flags

if TYPE_CHECKING:
    from quanta.runner.attention import DecodeBatch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("paged_decode.c")
KERNEL_CACHE_ENV = "QUANTA_KERNEL_CACHE"
# -fassociative-math (with the two flags it requires) lets the compiler vectorise the dot
# products and sums; NaN and infinity keep their meaning (no -ffinite-math-only).
# -fopenmp-simd honours the source's `omp simd` marks without linking an OpenMP runtime.
FLAGS = (
    "-O3",
    "-march=native",
    "-fno-math-errno",
    "-fassociative-math",
    "-fno-signed-zeros",
    "-fno-trapping-math",
    "-fopenmp-simd",
    "-shared",
    "-fPIC",
)
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}


def compiler() -> str | None:
    """The C compiler the kernel is built with (``CC``, else cc or gcc on PATH)."""
    named = os.environ.get("CC", "").strip()
    if named:
        return shutil.which(named)
    return shutil.which("cc") or shutil.which("gcc")


def c_address(fn: ctypes._CFuncPtr) -> int:
    """Where a loaded C function lies, for C code that calls it through a pointer."""
    return ctypes.cast(fn, ctypes.c_void_p).value or 0


def supports(dtype: torch.dtype, device: torch.device) -> bool:
    return device.type == "cpu" and dtype in _DTYPE_CODES


class NativeDecode:
    """``(rows [B, H, D], key_cache, value_cache [slots, KVH, D], slots, bounds, scale)``
    -> ``[B, H, D]``; ``bounds`` ``[B + 1]`` delimits each row's share of ``slots``. With
    ``window`` a row attends to its last ``window`` slots only (a sliding window), with
    ``softcap`` its scores are soft-capped (Gemma 2)."""

    def __init__(self, library: ctypes.CDLL) -> None:
        fn = library.quanta_paged_decode
        fn.restype = ctypes.c_int
        i64, f32 = ctypes.c_int64, ctypes.c_float
        fn.argtypes = [ctypes.c_void_p] * 6 + [i64] * 5 + [f32, i64, f32, ctypes.c_int]
        self._fn = fn

    @property
    def address(self) -> int:
        """The kernel's C entry point (``decode_chain`` calls it directly)."""
        return c_address(self._fn)

    def __call__(
        self,
        rows: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slots: torch.Tensor,
        bounds: torch.Tensor,
        scale: float,
        window: int = 0,
        softcap: float | None = None,
    ) -> torch.Tensor:
        num_rows, heads, dim = rows.shape
        kv_heads = key_cache.shape[1]
        if not (
            rows.dtype == key_cache.dtype == value_cache.dtype
            and rows.dtype in _DTYPE_CODES
            and rows.is_contiguous()
            and key_cache.stride() == value_cache.stride() == (kv_heads * dim, dim, 1)
            and slots.dtype == bounds.dtype == torch.int64
            and slots.is_contiguous()
            and bounds.is_contiguous()
            and heads % kv_heads == 0
        ):
            raise ValueError("native decode attention: unsupported layout or dtype")
        out = torch.empty_like(rows)
        status = self._fn(
            out.data_ptr(),
            rows.data_ptr(),
            key_cache.data_ptr(),
            value_cache.data_ptr(),
            slots.data_ptr(),
            bounds.data_ptr(),
            num_rows,
            heads,
            kv_heads,
            dim,
            kv_heads * dim,
            scale,
            window,
            softcap or 0.0,
            _DTYPE_CODES[rows.dtype],
        )
        if status != 0:
            raise MemoryError("native decode attention could not allocate its scratch space")
        return out


class NativeDecodeKernel:
    """The kernel as the runner's ``DecodeKernel`` (``quanta.runner.decode_kernel``). It also
    takes a sliding window and a soft-cap, which the torch kernels do not: a layer with either
    (``quanta.runner.layers.attention.windowed_attention``) passes them when its decode rows
    run under this kernel, so they attend as the decode chain's rows do."""

    def __init__(self, native: NativeDecode) -> None:
        self.native = native

    def __call__(
        self,
        rows: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        batch: DecodeBatch,
        scale: float,
        window: int = 0,
        softcap: float | None = None,
    ) -> torch.Tensor:
        return self.native(
            rows, key_cache, value_cache, batch.slots, batch.bounds, scale, window, softcap
        )


def load() -> NativeDecode | None:
    """The kernel, built here first if this machine has no build of it yet; None (with a
    warning) where it cannot be built."""
    cc = compiler()
    if cc is None:
        log.warning("no C compiler found: native decode attention is unavailable")
        return None
    try:
        return NativeDecode(ctypes.CDLL(str(_build(cc))))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        log.warning("building native decode attention failed: %s", detail)
        return None


def load_library(
    source_path: Path, flags: tuple[str, ...], what: str, libs: tuple[str, ...] = ()
) -> ctypes.CDLL | None:
    """``source_path`` built (or found built) and loaded; None, with a warning naming
    ``what``, where no compiler is found or the build fails (the caller falls back)."""
    cc = compiler()
    if cc is None:
        return None
    try:
        return ctypes.CDLL(str(build(source_path, flags, cc, libs)))
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("building %s failed: %s", what, getattr(exc, "stderr", "") or exc)
        return None


def _build(cc: str) -> Path:
    return build(SOURCE, FLAGS, cc)


def build(source_path: Path, flags: tuple[str, ...], cc: str, libs: tuple[str, ...] = ()) -> Path:
    """The shared object of ``source_path`` built with ``flags`` and linked with ``libs``
    (cached, see the module docstring); raises ``OSError`` or ``subprocess.SubprocessError``
    when it cannot be built."""
    source = source_path.read_bytes()
    key = hashlib.sha256(
        b"\0".join(
            [
                source,
                " ".join((*flags, *libs)).encode(),
                cc.encode(),
                " ".join(sorted(cpu_flags())).encode(),
            ]
        )
    ).hexdigest()[:16]
    cache = Path(os.environ.get(KERNEL_CACHE_ENV) or Path.home() / ".cache" / "quanta" / "kernels")
    target = cache / f"{source_path.stem}-{key}.so"
    if target.exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: processes starting together never load half a file.
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        built = Path(tmp) / target.name
        subprocess.run(
            [cc, *flags, "-o", str(built), str(source_path), *libs, "-lm"],
            check=True,
            capture_output=True,
            text=True,
            timeout=120,
        )
        os.replace(built, target)
    log.info("built %s: %s", source_path.name, target)
    return target
