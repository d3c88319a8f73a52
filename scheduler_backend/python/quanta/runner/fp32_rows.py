"""fp32 products of up to 64 rows through ``fp32_rows.c``, reading the weight as stored.

A decode step of up to ``FEW_ROWS`` rows streams each fp32 weight once; MKL does that at one
row but slows to half the memory bandwidth from four rows, oneDNN reads the stored weight at
7-9 GB/s up to eight rows (its blocked copy would cost the one-row rate and a second copy of
the weight), and from 16 to 64 rows it reaches about half the core's arithmetic rate. Up to
``DOT_ROWS`` rows the kernel multiplies each few weight rows with every row of x while they
sit in registers; from there it broadcasts each weight element against all rows of a
transposed x. Both prefetch the next weight rows, so the weight stream is the only memory
traffic (measured in ``docs/results/benchmarks.md``, "fp32 decode of a few rows" and "fp32
products of 9 to 64 rows"). Built at load and cached like the other native kernels; where it
cannot be (no AVX-512, no compiler) products keep MKL and oneDNN.
"""

from __future__ import annotations

import ctypes
import logging
import os
from functools import cache
from pathlib import Path

import torch

from quanta.runner import native_decode

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("fp32_rows.c")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
# Rows up to which the kernel serves a product (one thread, [4096, 768] and [768, 2048]
# weights out of cache, against oneDNN): 1.2-1.6x at 9-32 rows, 1.05-1.07x at 64; with x in
# chunks of 64 rows, 0.95-1.1x at 96 and 0.45-0.8x from 192, so oneDNN keeps those.
FEW_ROWS = 64


class Fp32Rows:
    """``product(x, weight, bias, relu)``: ``x [rows, K] weight^T (+ bias)`` in fp32."""

    def __init__(self, library: ctypes.CDLL) -> None:
        fn = library.quanta_fp32_rows
        p, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
        fn.argtypes = [p] * 4 + [i32] + [i64] * 3 + [i32]  # y x w bias, relu, m n k, threads
        fn.restype = ctypes.c_int
        self._fn = fn
        self.max_rows = min(FEW_ROWS, int(library.quanta_fp32_rows_max()))
        # Calls of up to this many rows sum each output across lanes, more in K's order: a
        # row's bits are the same whichever rows share a call on the same side of it.
        self.dot_rows = int(library.quanta_fp32_rows_dot_max())

    def product(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, relu: bool
    ) -> torch.Tensor:
        """``y [rows, N]``; x, weight and bias fp32 on the CPU, the weight ``[N, K]``
        contiguous, at most ``max_rows`` rows."""
        x = x.contiguous()
        rows, k = x.shape
        n = weight.shape[0]
        if not (
            0 < rows <= self.max_rows
            and x.dtype == weight.dtype == torch.float32
            and weight.is_contiguous()
            and weight.shape[1] == k
            and (bias is None or (bias.dtype == torch.float32 and bias.is_contiguous()))
        ):
            raise ValueError("fp32 few-rows product: unsupported shape, layout or dtype")
        y = torch.empty(rows, n, dtype=torch.float32)
        bias_ptr = None if bias is None else bias.data_ptr()
        threads = torch.get_num_threads()
        if self._fn(y.data_ptr(), x.data_ptr(), weight.data_ptr(), bias_ptr, int(relu), rows,
                    n, k, threads):  # fmt: skip
            raise RuntimeError("the fp32 few-rows kernel cannot run here (or had no memory)")
        return y


FP32_ROWS_ENV = "QUANTA_FP32_ROWS"


def load() -> Fp32Rows | None:
    """The kernel, built first where this machine has no build of it; None where the CPU has
    no AVX-512 or no compiler is found, or ``QUANTA_FP32_ROWS=off`` (products then stay on
    MKL and oneDNN: to compare the two on one machine, or to set the kernel aside)."""
    setting = os.environ.get(FP32_ROWS_ENV, "").strip().lower()
    if setting not in ("", "on", "off"):
        raise ValueError(f"{FP32_ROWS_ENV}={setting!r}: use on or off")
    return None if setting == "off" else _load()


@cache
def _load() -> Fp32Rows | None:
    """One build and one handle per process."""
    library = native_decode.load_library(SOURCE, FLAGS, "the fp32 few-rows kernel")
    if library is None:
        return None
    if not library.quanta_fp32_rows_available():
        log.info("fp32 few-rows kernel: no AVX-512 here; fp32 products stay on MKL and oneDNN")
        return None
    return Fp32Rows(library)
