"""bf16 projections through the panel kernel (``panel_linear.c``): one copy of the weight,
packed at load, streamed at memory speed at batch 1 and as fast as oneDNN at prefill sizes.

At batch 1 each decode step reads every weight once, so a step's products take the weights'
bytes over the memory bandwidth plus a fixed cost per call. oneDNN's prepacked bf16 products
streamed 6.6-7.6 GB/s on one row with ~17 us per call; the panel kernel reads a layout made
for AVX512_BF16's pair dot product (``[N/64][K/2][64][2]``: one contiguous stream per 64
output columns, no horizontal sums) and measured on SmolLM2-135M's 121 products, one
thread (docs/results/benchmarks.md): 1.5x oneDNN at 1 row, 1.25x at 8, 1.1x at 32, level at 96-256.

It runs where the CPU has AVX512_BF16 and a C compiler is found (built at load and cached,
like the decode-attention kernel); ``auto`` picks it for bf16 there and keeps oneDNN
elsewhere. fp32 stays on oneDNN: its products already stream near the bound.

Where the CPU also has AMX (and Linux grants the process its tile state), products of a few
rows and more (prefill, wide decode batches) run on AMX tiles, reading the same packed panel:
its pair-interleaved rows are already the operand TDPBF16PS takes, so there is still one copy
of the weight. A row's value then depends on whether its step had that many rows (the tile
product sums in another order), as oneDNN's does.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable
from functools import cache
from pathlib import Path

import torch

from quanta.runner import native_decode

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("panel_linear.c")
PANEL = 64  # output columns per panel (panel_linear.c)
# -fopenmp: output panels are split over torch's own OpenMP runtime (torch ships libgomp).
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")


class PanelLibrary:
    """The kernel's three entry points: packed size, pack, product."""

    def __init__(self, library: ctypes.CDLL) -> None:
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        # AMX tiles, asked of Linux once per process: products of ``amx_rows`` rows and more
        # run on them (prefill, wide decode batches); None where they cannot.
        self.amx_rows: int | None = None
        if library.quanta_panel_amx_init():
            self.amx_rows = int(library.quanta_panel_amx_rows())
        # int8 codes at a few rows: ``vnni`` (x in 16-bit fixed point per block of 128
        # columns, vpdpwssd) or ``widen`` (each code widened to bf16); panel_linear.c.
        self.int8_rows = "vnni" if library.quanta_panel_int8_vnni() else "widen"
        self._size = library.quanta_panel_packed_size
        self._size.argtypes, self._size.restype = [i64, i64], i64
        self._pack = library.quanta_panel_pack
        self._pack.argtypes, self._pack.restype = [p, p, i64, i64], None
        self._product = library.quanta_panel_bf16
        self._product.argtypes = [p, p, p, p, i64, i64, i64, ctypes.c_int]
        self._product.restype = None
        self._product_relu = library.quanta_panel_bf16_relu
        self._product_relu.argtypes, self._product_relu.restype = self._product.argtypes, None
        self._pack_i8 = library.quanta_panel_pack_i8
        self._pack_i8.argtypes, self._pack_i8.restype = [p, p, i64, i64], None
        self._product_i8 = library.quanta_panel_i8
        self._product_i8.argtypes = [p, p, p, p, p, i64, i64, i64, ctypes.c_int]
        self._product_i8.restype = None
        self._size_i4 = library.quanta_panel_i4_packed_size
        self._size_i4.argtypes, self._size_i4.restype = [i64, i64], i64
        self._pack_i4 = library.quanta_panel_pack_i4
        self._pack_i4.argtypes, self._pack_i4.restype = [p, p, i64, i64], None
        self._product_i4 = library.quanta_panel_i4
        self._product_i4.argtypes = [p, p, p, p, p, i64, i64, i64, i64, ctypes.c_int]
        self._product_i4.restype = ctypes.c_int

    @property
    def addresses(self) -> tuple[int, int, int]:
        """The bf16, int8 and int4 products' C entry points (``decode_chain`` calls them
        directly)."""
        fns = (self._product, self._product_i8, self._product_i4)
        return tuple(native_decode.c_address(fn) for fn in fns)  # type: ignore[return-value]

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """``weight`` ``[N, K]`` bf16 in the kernel's panel layout (a flat bf16 tensor)."""
        return self._packed(self._pack, weight, torch.bfloat16)

    def pack_int8(self, codes: torch.Tensor) -> torch.Tensor:
        """int8 ``codes`` ``[N, K]`` in the same panel layout (a flat int8 tensor)."""
        return self._packed(self._pack_i8, codes, torch.int8)

    def pack_int4(self, codes: torch.Tensor) -> torch.Tensor:
        """int4 ``codes`` ``[N, K]`` (one per element, 0..15; K even) two a byte in the panel
        layout (a flat uint8 tensor, ``panel_linear.c``'s ``quanta_panel_pack_i4``)."""
        codes = codes.detach().to(torch.uint8).contiguous()
        n, k = codes.shape
        if k % 2:
            raise ValueError(f"int4 panels pair input columns: K={k} is odd")
        packed = torch.empty(self._size_i4(n, k), dtype=torch.uint8)
        self._pack_i4(packed.data_ptr(), codes.data_ptr(), n, k)
        return packed

    @staticmethod
    def int4_scales(scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
        """Per-group ``scales`` and ``mins`` ``[N, groups]`` as the kernel reads them: fp16
        ``[panels, groups, 2, PANEL]`` (columns past N padded with zeros)."""
        n, groups = scales.shape
        panels = -(-n // PANEL)
        both = torch.zeros(panels * PANEL, groups, 2, dtype=torch.float16)
        both[:n, :, 0], both[:n, :, 1] = scales.to(torch.float16), mins.to(torch.float16)
        return both.view(panels, PANEL, groups, 2).permute(0, 2, 3, 1).contiguous().view(-1)

    def product_int4(
        self,
        x: torch.Tensor,
        packed: torch.Tensor,
        scales: torch.Tensor,
        bias: torch.Tensor | None,
        n: int,
        group: int,
    ) -> torch.Tensor:
        """``x [rows, K] W^T (+ bias)`` with ``W = code * scale + min`` per group of ``group``
        input columns: bf16 in and out, ``packed`` and ``scales`` from ``pack_int4`` and
        ``int4_scales``."""
        weights = (packed.data_ptr(), scales.data_ptr())
        return self._run(self._product_i4, x, n, weights, bias, group=(group,))

    def _packed(
        self, fn: Callable[..., None], weight: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        weight = weight.detach().to(dtype).contiguous()
        n, k = weight.shape
        packed = torch.empty(self._size(n, k), dtype=dtype)
        fn(packed.data_ptr(), weight.data_ptr(), n, k)
        return packed

    def product_int8(
        self,
        x: torch.Tensor,
        packed: torch.Tensor,
        scales: torch.Tensor,
        bias: torch.Tensor | None,
        n: int,
    ) -> torch.Tensor:
        """``x [rows, K] (codes * scales)^T (+ bias)``: bf16 in and out, fp32 ``scales [N]``."""
        return self._run(self._product_i8, x, n, (packed.data_ptr(), scales.data_ptr()), bias)

    def product(
        self,
        x: torch.Tensor,
        packed: torch.Tensor,
        bias: torch.Tensor | None,
        n: int,
        *,
        relu: bool = False,
    ) -> torch.Tensor:
        """``x [rows, K] W^T (+ bias)`` in bf16, on torch's thread count; with ``relu`` the
        ReLU rides on the product's rounding instead of a second pass over ``y``."""
        fn = self._product_relu if relu else self._product
        return self._run(fn, x, n, (packed.data_ptr(),), bias)

    @staticmethod
    def _run(
        fn: Callable[..., int | None],
        x: torch.Tensor,
        n: int,
        weights: tuple[int, ...],
        bias: torch.Tensor | None,
        group: tuple[int, ...] = (),
    ) -> torch.Tensor:
        """``y [rows, n]`` from ``fn(y, x, *weights, bias, rows, n, k, *group, threads)``,
        ``weights`` being the data pointers the product reads (int4 also takes its group
        size, and returns nonzero when it could not allocate its group sums)."""
        x = x.contiguous()
        rows, k = x.shape
        y = torch.empty(rows, n, dtype=torch.bfloat16)
        if rows:
            bias_ptr = None if bias is None else bias.data_ptr()
            threads = torch.get_num_threads()
            if fn(y.data_ptr(), x.data_ptr(), *weights, bias_ptr, rows, n, k, *group, threads):
                raise MemoryError("the int4 panel kernel could not allocate its group sums")
        return y


@cache
def load() -> PanelLibrary | None:
    """The kernel, built here first if this machine has none yet; None where this CPU has no
    AVX512_BF16 or no compiler is found (then oneDNN serves bf16, never broken). Cached: one
    build and one handle per process, as the library is the same for every projection."""
    library = native_decode.load_library(SOURCE, FLAGS, "the panel linear kernel")
    if library is None:
        return None
    if not library.quanta_panel_available():
        log.info("panel linear kernel: this CPU has no AVX512_BF16; bf16 products use oneDNN")
        return None
    panel = PanelLibrary(library)
    int8 = "int8 decode rows on AVX512_VNNI" if panel.int8_rows == "vnni" else "int8 widened"
    if panel.amx_rows is not None:
        log.info(
            "panel linear kernel: AVX512_BF16, AMX tiles from %d rows, %s",
            panel.amx_rows,
            int8,
        )
    else:
        log.info("panel linear kernel: AVX512_BF16 (no AMX tiles here), %s", int8)
    return panel


def tiles() -> str:
    """What the panel kernel runs on beside AVX512_BF16, for logs and ``quanta_engine_info``:
    ``amx`` (from a few rows up) or ``none``."""
    panel = load()
    return "amx" if panel is not None and panel.amx_rows is not None else "none"


def supports(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the panel kernel runs ``dtype`` on ``device`` here."""
    return device.type == "cpu" and dtype == torch.bfloat16 and load() is not None
