"""The native prefill-attention kernel (``paged_prefill.c``): bf16 chunks on AMX tiles, read
in place from the paged cache; built once per machine and loaded through ctypes like the
decode kernel (``quanta.runner.native_decode``).

It serves a prefill chunk when the model runs bf16 on a CPU whose AMX tiles Linux grants this
process, with a head size that is a multiple of 32, sliding-window and soft-capped layers
included; every other chunk (fp32, fp16, CUDA, a CPU without AMX, no C compiler) keeps SDPA
(or, windowed or soft-capped, HF's eager sequence). Measured in ``docs/prefix-caching.md``.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os

import torch

from quanta.runner import native_decode
from quanta.runner.cpu import cpu_flags

log = logging.getLogger(__name__)

SOURCE = native_decode.SOURCE.with_name("paged_prefill.c")
FLAGS = ("-O3", "-march=native", "-shared", "-fPIC")
# Head sizes the kernel's scratch rows hold (MAX_DIM in the C source).
MAX_HEAD_DIM = 256


class NativePrefill:
    """``(out, q [n, H, D] rows of one chunk, key_cache, value_cache [slots, KVH, D],
    block_ids, block_size, start, scale, window, softcap)``: writes the chunk's attention
    into ``out``; ``window`` (0: none) and ``softcap`` (None: none) as the layer's own."""

    def __init__(self, library: ctypes.CDLL) -> None:
        fn = library.quanta_paged_prefill
        fn.restype = ctypes.c_int
        p, i64, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
        fn.argtypes = [p] * 5 + [i64] * 9 + [f32, i64, f32]  # ... scale, window, softcap
        self._fn = fn

    @staticmethod
    def serves(q: torch.Tensor, key_cache: torch.Tensor) -> bool:
        """Whether this chunk's layout is one the kernel reads: bf16 on CPU, heads of a
        multiple of 32 columns, each head's columns contiguous."""
        heads, dim = q.shape[1], q.shape[2]
        kv_heads = key_cache.shape[1]
        return (
            q.device.type == "cpu"
            and q.dtype == key_cache.dtype == torch.bfloat16
            and dim % 32 == 0
            and dim <= MAX_HEAD_DIM
            and heads % kv_heads == 0
            and q.stride(2) == 1
            and q.stride(1) == dim
            and key_cache.stride() == (kv_heads * dim, dim, 1)
        )

    def __call__(
        self,
        out: torch.Tensor,
        q: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_ids: torch.Tensor,
        block_size: int,
        start: int,
        scale: float,
        window: int = 0,
        softcap: float | None = None,
    ) -> None:
        n, heads, dim = q.shape
        kv_heads = key_cache.shape[1]
        if not (
            self.serves(q, key_cache)
            and value_cache.stride() == key_cache.stride()
            and value_cache.dtype == key_cache.dtype
            and out.dtype == q.dtype
            and out.shape == q.shape
            and out.stride(2) == 1
            and out.stride(1) == dim
            and block_ids.dtype == torch.int64
            and block_ids.is_contiguous()
            and window >= 0
            and (softcap is None or softcap > 0)
        ):
            raise ValueError("native prefill attention: unsupported layout or dtype")
        status = self._fn(
            out.data_ptr(),
            q.data_ptr(),
            key_cache.data_ptr(),
            value_cache.data_ptr(),
            block_ids.data_ptr(),
            block_size,
            start,
            n,
            heads,
            kv_heads,
            dim,
            q.stride(0),
            out.stride(0),
            kv_heads * dim,
            scale,
            window,
            softcap or 0.0,
        )
        if status == -1:
            raise MemoryError("native prefill attention could not allocate its scratch space")
        if status != 0:
            raise RuntimeError("native prefill attention cannot run here (no AMX tiles)")


@functools.cache
def load() -> NativePrefill | None:
    """The kernel where it runs here (built first if this machine has no build of it), once
    per process; None where it cannot: no AMX in this CPU's flags, Linux refused the tile
    state, or no C compiler."""
    if not {"amx_tile", "amx_bf16", "avx512_bf16"} <= cpu_flags():
        return None
    library = native_decode.load_library(SOURCE, FLAGS, "native prefill attention")
    if library is None:
        return None
    if not library.quanta_prefill_init():
        # the compiler did not target AMX, or Linux refused this process the tile state
        log.warning("AMX tiles are unavailable to the kernel: prefill attention stays on SDPA")
        return None
    return NativePrefill(library)


PREFILL_KERNEL_ENV = "QUANTA_PREFILL_KERNEL"


def choose(
    *,
    dtype: torch.dtype,
    device: torch.device,
    block_size: int,
    head_dim: int,
) -> tuple[NativePrefill | None, str]:
    """(the kernel, ``amx``) where prefill chunks run natively, else (None, ``sdpa``).

    Natively: bf16 on a CPU with AMX and a C compiler, with blocks of a multiple of 16 keys
    (a tile's key rows lie in one block) and heads of a multiple of 32 columns, whichever
    kernel decodes (the decode kernel's choice weighs torch.compile's costs, not this).
    ``QUANTA_PREFILL_KERNEL=sdpa`` keeps SDPA, to compare the two on one machine."""
    override = os.environ.get(PREFILL_KERNEL_ENV, "").strip()
    if override not in ("", "amx", "sdpa"):
        raise ValueError(f"{PREFILL_KERNEL_ENV}={override!r}: use amx or sdpa")
    if (
        override == "sdpa"
        or dtype != torch.bfloat16
        or device.type != "cpu"
        or block_size % 16
        or head_dim % 32
        or head_dim > MAX_HEAD_DIM
    ):
        return None, "sdpa"
    kernel = load()
    return (kernel, "amx") if kernel is not None else (None, "sdpa")
