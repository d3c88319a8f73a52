"""Weight-only quantized linears: int8 and int4 weights, bf16 or fp32 activations.

The stored layout (what ``quanta build --quantization`` and the GGUF import write beside each
linear ``X``, in place of ``X.weight``), groups running along the input dimension:

- ``X.qweight``: int8 ``[out, in]`` (int8), or uint8 ``[out, in/2]`` (int4: column ``2j`` in
  the low nibble of byte ``j``, ``2j+1`` in the high one, unsigned 0..15);
- ``X.scales``: ``[out, in/group]``, fp16 for int4 and grouped int8 (GGUF's Q8_0), as the
  GGUF file holds them and the int4 kernel reads them; fp32 for int8 per output channel
  (``[out, 1]``), as its kernel multiplies;
- ``X.mins``: fp16 ``[out, in/group]``, the weight at code 0 (GGUF Q4_1's ``m``), int4 only
  and absent when symmetric.

The weight is ``q * scale`` (int8) and ``(q - 8) * scale + zero`` (int4), with ``zero = min +
8 scale`` computed in fp32 at load. The int4 form is torch's own
``_weight_int4pack_mm_for_cpu`` convention (checked numerically in
``tests/runner/test_quantized.py``), so llama.cpp's Q4_0 (``d * (q - 8)``) is ``zero = 0`` and Q4_1
(``d * q + m``) is ``zero = m + 8d``: both are kept exactly, without a round trip through bf16.
Engines of format 1 (``quanta.build.manifest.ENGINE_FORMAT``) stored fp32 scales and
``X.zeros`` instead of ``X.mins``; they load as they are.

Kernels, chosen at load (``kernel`` names the one that runs):

- int8 per-channel, bf16, on a CPU with AVX512_BF16: ``native-int8``, the panel kernel of
  ``panel_linear.c`` reading int8 codes, the column's scale applied to the fp32 sum. Up to 4
  rows, where the CPU has AVX512_VNNI (every AVX512_BF16 CPU does), x is put in 16-bit fixed
  point per 128 columns once per call and each code only sign-extends for a 16-bit integer
  dot product: 2-3.5x the widening path at one row, faster than the bf16 panel kernel on
  half its bytes (docs/quantization.md). Without VNNI the codes widen to bf16 in registers
  (bf16 holds every code exactly), compute-bound at about 10 GB/s of codes. From 5 rows up
  each 64-column panel is widened once into L2 and the bf16 path (AMX tiles where present)
  reads it;
- int8 per-channel, bf16, elsewhere: ``_weight_int8pack_mm`` up to ``DEQUANT_ROWS`` rows
  (decode); above it the weight is dequantized to bf16 for the call and the bf16 GEMM runs
  (prefill), since torch's int8 kernel is slower than dequantize-then-GEMM there (measured:
  3.5 ms against 1.2 + 1.9 ms for a 3072x576 product at 32 rows, one thread);
- int4 grouped, bf16, on a CPU with AVX512_BF16: ``native-int4``, the panel kernel reading
  two codes a byte (each widened to a bf16 word in registers, the group's scale and min
  applied to the fp32 partial sums: ``panel_linear.c``); at one row it streams the codes at
  memory speed, 1.6-1.7x torch's int4 kernel (docs/quantization.md). Scales and mins are
  kept in fp16, which holds GGUF's exactly; a weight whose scales fp16 would round by more
  than 2^-10 keeps torch's kernel;
- int4 grouped, bf16, elsewhere: ``_weight_int4pack_mm_for_cpu`` at every row count (the
  packed layout cannot be dequantized cheaply, and keeping an unpacked copy would double the
  memory);
- on CUDA, bf16: ``_weight_int4pack_mm`` (torch's tinygemm kernel, the same int4
  convention, its own tile layout from ``_convert_weight_to_int4pack``) for int4, and
  ``_weight_int8pack_mm`` for int8 per channel, where torch has a CUDA kernel for it; fp16
  and fp32 (tinygemm is bf16 only) dequantize per call;
- grouped int8 (GGUF Q8_0, group 32) and every fp32 engine: dequantize per call, then the
  float GEMM. ``_weight_int8pack_mm`` takes one scale per output channel only, and torch's
  int kernels have no fast fp32 path on CPU (5-15x slower than the fp32 GEMM, measured), so
  those keep the memory saving but not the speed.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from quanta.runner import panel_linear
from quanta.runner.projection import Projection

log = logging.getLogger(__name__)

# Rows above which an int8 product dequantizes to bf16 and runs the bf16 GEMM.
DEQUANT_ROWS = 32
INT4_GROUP_SIZES = (32, 64, 128, 256)
# tinygemm's k-tiles per inner loop on CUDA: 8 (as torch's own int4 tests use) asks the
# input width to be a multiple of 8 * 16 columns.
CUDA_INNER_K_TILES = 8
QUANT_SUFFIXES = (".qweight", ".scales", ".mins", ".zeros")
# fp16's smallest subnormal: the least int4 scale that is stored (in fp16) as more than 0.
_FP16_LEAST = 2.0**-24
# Kernels whose layout ``QuantizedLinear.rows`` reads back (not torch's int4pack tiles).
ROW_KERNELS = ("native-int8", "native-int4", "int8pack", "dequant")


@dataclass(frozen=True)
class QuantizedWeight:
    """One linear's weight as stored: ``mode`` int8 or int4, ``group_size`` input columns per
    scale (``in_features`` for int8 per channel); ``zeros`` None when symmetric."""

    mode: str
    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None

    @property
    def out_features(self) -> int:
        return int(self.qweight.shape[0])

    @property
    def in_features(self) -> int:
        cols = int(self.qweight.shape[1])
        return cols * 2 if self.mode == "int4" else cols

    @property
    def group_size(self) -> int:
        return self.in_features // int(self.scales.shape[1])

    @property
    def nbytes(self) -> int:
        parts = [self.qweight, self.scales] + ([] if self.zeros is None else [self.zeros])
        return sum(t.numel() * t.element_size() for t in parts)

    @staticmethod
    def from_tensors(tensors: dict[str, torch.Tensor]) -> QuantizedWeight:
        """From the stored ``qweight``/``scales``/``mins`` of one linear (suffixes without
        dots); a format-1 engine's ``zeros`` are read as they are."""
        q = tensors["qweight"]
        mode = "int8" if q.dtype == torch.int8 else "int4"
        if mode == "int4" and q.dtype != torch.uint8:
            raise ValueError(f"qweight of dtype {q.dtype}: expected int8 or uint8 (int4)")
        scales = tensors["scales"].float()
        zeros, mins = tensors.get("zeros"), tensors.get("mins")
        if mins is not None:
            zeros = mins.float() + 8 * scales
        return QuantizedWeight(mode, q, scales, None if zeros is None else zeros.float())

    def tensors(self) -> dict[str, torch.Tensor]:
        """The stored form (module docstring): what the kernels read, no wider. Scales that
        fp16 does not hold exactly (a weight not from ``quantize`` or a GGUF file) raise."""
        if self.mode == "int8" and self.group_size == self.in_features:
            return {"qweight": self.qweight, "scales": self.scales}
        scales = self.scales.half()
        if not torch.equal(scales.float(), self.scales.float()):
            raise ValueError("int4 and grouped int8 scales are stored in fp16, which moves these")
        out = {"qweight": self.qweight, "scales": scales}
        if self.zeros is not None:
            # NOTE: exact where zero = min + 8 scale was (as ``quantize`` and a GGUF's Q4_1
            # give: fp16 min and scale, summed in fp32).
            out["mins"] = _mins(self).half()
        return out

    def codes(self) -> torch.Tensor:
        """The integer codes ``[out, in]`` as int32 (int4: unsigned 0..15)."""
        if self.mode == "int8":
            return self.qweight.to(torch.int32)
        q = self.qweight
        return torch.stack((q & 0x0F, q >> 4), dim=-1).reshape(q.shape[0], -1).to(torch.int32)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight ``[out, in]`` in ``dtype``: computed in fp32, rounded once."""
        groups = self.scales.shape[1]
        q = self.codes().float().view(self.out_features, groups, -1)
        if self.mode == "int4":
            q = q - 8
        w = q * self.scales[..., None]
        if self.zeros is not None:
            w = w + self.zeros[..., None]
        return w.view(self.out_features, self.in_features).to(dtype)


def quantize(weight: torch.Tensor, mode: str, group_size: int, symmetric: bool) -> QuantizedWeight:
    """Round-to-nearest weight-only quantization of ``weight [out, in]``.

    int8 is symmetric per output channel (``group_size`` is ignored: the torch kernel takes one
    scale per channel). int4 is per group of ``group_size`` input columns; symmetric maps
    ``[-8 s, 7 s]`` with ``s = absmax / 8`` (zero = 0), asymmetric maps ``[min, max]`` onto 0..15.
    int4 scales and mins are rounded to fp16 before the codes are chosen, so the stored fp16
    values are the ones the codes were fitted to.
    """
    w = weight.detach().float()
    out_features, in_features = w.shape
    if mode == "int8":
        scale = (w.abs().amax(dim=1, keepdim=True) / 127).clamp(min=1e-12)
        q = torch.round(w / scale).clamp(-127, 127).to(torch.int8)
        return QuantizedWeight("int8", q, scale, None)
    if mode != "int4":
        raise ValueError(f"unknown quantization {mode!r}; use int8 or int4")
    if group_size not in INT4_GROUP_SIZES or in_features % group_size:
        raise ValueError(
            f"int4 group size {group_size} must be one of {INT4_GROUP_SIZES} and divide "
            f"in_features {in_features}"
        )
    g = w.view(out_features, in_features // group_size, group_size)
    zeros: torch.Tensor | None
    if symmetric:
        scale = _fp16((g.abs().amax(dim=-1) / 8).clamp(min=_FP16_LEAST))
        codes = torch.round(g / scale[..., None]) + 8
        zeros = None
    else:
        lo, hi = _fp16(g.amin(dim=-1)), g.amax(dim=-1)
        scale = _fp16(((hi - lo) / 15).clamp(min=_FP16_LEAST))
        codes = torch.round((g - lo[..., None]) / scale[..., None])
        zeros = lo + 8 * scale  # (q - 8) * scale + zero == q * scale + lo
    u = codes.clamp(0, 15).to(torch.uint8).view(out_features, in_features)
    packed = u[:, 0::2] | (u[:, 1::2] << 4)
    return QuantizedWeight("int4", packed.contiguous(), scale, zeros)


def _fp16(t: torch.Tensor) -> torch.Tensor:
    """``t`` rounded to fp16's values, kept in fp32."""
    return t.half().float()


def concat(weights: Sequence[QuantizedWeight]) -> QuantizedWeight:
    """One weight whose output rows are each part's in turn (a fused q/k/v or gate/up)."""
    first = weights[0]
    if len(weights) == 1:
        return first
    if any(w.mode != first.mode or w.group_size != first.group_size for w in weights):
        raise ValueError("fused projections must share one quantization mode and group size")
    zeros = None
    if any(w.zeros is not None for w in weights):
        zeros = torch.cat([w.zeros if w.zeros is not None else 0 * w.scales for w in weights])
    return QuantizedWeight(
        first.mode,
        torch.cat([w.qweight for w in weights]),
        torch.cat([w.scales for w in weights]),
        zeros,
    )


class QuantizedLinear(Projection):
    """``act(x W^T + b)`` with ``W`` kept quantized; ``kernel`` names what runs (see the
    module docstring): ``native-int8``, ``native-int4``, ``int8pack``, ``int4pack`` or
    ``dequant``."""

    def __init__(
        self,
        weight: QuantizedWeight,
        bias: torch.Tensor | None,
        activation: str,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.out_features, weight.in_features
        self.activation = activation
        self.mode, self.group_size = weight.mode, weight.group_size
        self.register_buffer("bias", None if bias is None else bias.to(dtype))
        self.kernel = _pick_kernel(weight, dtype)
        library = panel_linear.load() if self.kernel.startswith("native") else None
        self._library = library
        if library is not None and self.kernel == "native-int4":
            self.register_buffer("qweight", library.pack_int4(weight.codes()))
            self.register_buffer("scales", library.int4_scales(weight.scales, _mins(weight)))
        elif library is not None:
            self.register_buffer("qweight", library.pack_int8(weight.qweight))
            self.register_buffer("scales", weight.scales.view(-1).float().contiguous())
        elif self.kernel == "int8pack":
            # NOTE: a fresh (64-byte aligned) copy: torch 2.13's int8pack kernel crashes
            # (SIGSEGV) at 2+ rows on a weight whose data is not aligned, as a tensor read from
            # a safetensors file can be (tests/runner/test_quantized.py holds the case).
            self.register_buffer("qweight", torch.empty_like(weight.qweight).copy_(weight.qweight))
            self.register_buffer("scales", weight.scales.view(-1).to(dtype))
        elif self.kernel == "int4pack":
            self.register_buffer("qweight", _pack_int4(weight))
            zeros = weight.zeros if weight.zeros is not None else torch.zeros_like(weight.scales)
            # torch's layout: [in/group, out, 2], scale then zero.
            packed = torch.stack((weight.scales, zeros), dim=-1).transpose(0, 1).contiguous()
            self.register_buffer("scales_and_zeros", packed.to(dtype))
        else:
            self.register_buffer("qweight", weight.qweight)
            self.register_buffer("scales", weight.scales)
            self.register_buffer("zeros", weight.zeros)
        self.dtype = dtype

    @property
    def nbytes(self) -> int:
        """Bytes the weight holds in memory (quantized codes, scales and zeros)."""
        return sum(
            b.numel() * b.element_size()
            for n, b in self.named_buffers()
            if n != "bias" and b is not None
        )

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if self._library is not None and self.kernel == "native-int4":
            return self._library.product_int4(
                x, self.qweight, self.scales, self.bias, self.out_features, self.group_size
            )
        if self._library is not None:
            return self._library.product_int8(
                x, self.qweight, self.scales, self.bias, self.out_features
            )
        if self.kernel == "int8pack" and rows <= DEQUANT_ROWS:
            y = torch.ops.aten._weight_int8pack_mm(x.contiguous(), self.qweight, self.scales)
        elif self.kernel == "int8pack":
            w = self.qweight.to(x.dtype) * self.scales[:, None]
            return F.linear(x, w, self.bias)
        elif self.kernel == "int4pack" and x.is_cuda:
            y = torch.ops.aten._weight_int4pack_mm(
                x.contiguous(), self.qweight, self.group_size, self.scales_and_zeros
            )
        elif self.kernel == "int4pack":
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x.contiguous(), self.qweight, self.group_size, self.scales_and_zeros
            )
        else:
            weight = QuantizedWeight(self.mode, self.qweight, self.scales, self.zeros)
            return F.linear(x, weight.dequantize(x.dtype), self.bias)
        return y if self.bias is None else y.add_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._product(x)
        return torch.relu_(y) if self.activation == "relu" else y

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self._product(x).add_(residual)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, {self.mode} "
            f"group {self.group_size}, {self.kernel}"
        )

    def rows(self, ids: torch.Tensor) -> torch.Tensor | None:
        """Rows ``ids`` of the weight (output features), dequantized to the serving dtype
        (``code * scale (+ min)`` in fp32, rounded once), read from the layout this kernel
        holds: what a quantized embedding that shares a tied head's table looks up. None
        for torch's int4pack, whose tile layout has no cheap way back (not in ``ROW_KERNELS``)."""
        if self.kernel == "native-int8":
            pairs = (self.in_features + 1) // 2
            panel = self.qweight.view(-1, pairs, panel_linear.PANEL, 2)
            p, i = ids // panel_linear.PANEL, ids % panel_linear.PANEL
            codes = panel[p, :, i, :].reshape(len(ids), -1)[:, : self.in_features]
            return (codes.float() * self.scales[ids, None]).to(self.dtype)
        if self.kernel == "native-int4":
            return self._int4_panel_rows(ids)
        if self.kernel == "int8pack":
            return (self.qweight[ids].float() * self.scales[ids, None].float()).to(self.dtype)
        if self.kernel == "dequant":
            zeros = None if self.zeros is None else self.zeros[ids]
            picked = QuantizedWeight(self.mode, self.qweight[ids], self.scales[ids], zeros)
            return picked.dequantize(self.dtype)
        return None

    def _int4_panel_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """``rows`` from the int4 panel layout (``panel_linear.c``, ``quanta_panel_pack_i4``):
        of a pair row's 32 words, code ``32 v + j`` of the panel's ``2 * PANEL`` (column
        ``w // 2``, input ``2 kp + w % 2``) sits in bits ``4 v`` of word ``j``."""
        width, pairs = panel_linear.PANEL, self.in_features // 2
        words = self.qweight.view(torch.int16).view(-1, pairs, width // 2)
        p, i = ids // width, ids % width
        shift = (4 * ((2 * i) // 32))[:, None]
        codes = torch.stack(
            [(words[p, :, (2 * i + c) % 32] >> shift) & 0x0F for c in (0, 1)], dim=-1
        ).reshape(len(ids), self.in_features)
        groups = self.in_features // self.group_size
        sm = self.scales.view(-1, groups, 2, width)
        scale, low = sm[p, :, 0, i].float(), sm[p, :, 1, i].float()
        w = (
            codes.float().view(len(ids), groups, self.group_size) * scale[..., None]
            + low[..., None]
        )
        return w.view(len(ids), self.in_features).to(self.dtype)


def _pack_int4(weight: QuantizedWeight) -> torch.Tensor:
    """The codes in the tile layout of the device's int4 kernel."""
    codes = weight.codes().contiguous()
    if codes.is_cuda:
        # tinygemm reads two codes a byte, the even column in the high nibble
        pairs = (codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8)
        return torch.ops.aten._convert_weight_to_int4pack(pairs, CUDA_INNER_K_TILES)
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)


def _pick_kernel(weight: QuantizedWeight, dtype: torch.dtype) -> str:
    """The fastest correct kernel for this weight and activation dtype (module docstring)."""
    if dtype != torch.bfloat16:
        return "dequant"
    if weight.qweight.device.type == "cuda":
        return _pick_cuda_kernel(weight)
    if weight.qweight.device.type != "cpu":
        return "dequant"
    if weight.mode == "int8":
        if weight.group_size != weight.in_features:
            return "dequant"
        return "native-int8" if panel_linear.supports(dtype, weight.qweight.device) else "int8pack"
    if panel_linear.supports(dtype, weight.qweight.device) and _fp16_holds(weight):
        return "native-int4"
    if weight.group_size in INT4_GROUP_SIZES and weight.out_features % 16 == 0:
        return "int4pack"
    return "dequant"


def _mins(weight: QuantizedWeight) -> torch.Tensor:
    """Each group's weight at code 0: ``zero - 8 * scale`` (GGUF Q4_1's ``m``)."""
    zeros = weight.zeros if weight.zeros is not None else torch.zeros_like(weight.scales)
    return zeros.float() - 8 * weight.scales.float()


def _fp16_holds(weight: QuantizedWeight) -> bool:
    """Whether the int4 panel kernel's fp16 scales and mins keep ``weight``'s to 2^-10 of
    each (GGUF's, stored in fp16, exactly); torch's int4 kernel keeps them in bf16 (2^-8)."""
    for t in (weight.scales.float(), _mins(weight)):
        if ((t.half().float() - t).abs() > t.abs() * 2**-10).any():
            return False
    return weight.group_size % 2 == 0 and weight.in_features % weight.group_size == 0


def _pick_cuda_kernel(weight: QuantizedWeight) -> str:
    if weight.mode == "int8":
        per_channel = weight.group_size == weight.in_features
        return "int8pack" if per_channel and _cuda_int8pack(weight.qweight.device) else "dequant"
    fits = weight.out_features % 8 == 0 and weight.in_features % (CUDA_INNER_K_TILES * 16) == 0
    return "int4pack" if fits and weight.group_size in INT4_GROUP_SIZES else "dequant"


_CUDA_INT8PACK: dict[torch.device, bool] = {}


def _cuda_int8pack(device: torch.device) -> bool:
    """Whether this torch build has a CUDA kernel for ``_weight_int8pack_mm`` (older builds
    have CPU and MPS ones only): asked once per device with a one-row product."""
    if device not in _CUDA_INT8PACK:
        try:
            x = torch.ones(1, 64, dtype=torch.bfloat16, device=device)
            w = torch.ones(8, 64, dtype=torch.int8, device=device)
            s = torch.ones(8, dtype=torch.bfloat16, device=device)
            torch.ops.aten._weight_int8pack_mm(x, w, s)
            _CUDA_INT8PACK[device] = True
        except (RuntimeError, NotImplementedError):
            _CUDA_INT8PACK[device] = False
    return _CUDA_INT8PACK[device]


def make_quantized(
    linears: Sequence[nn.Linear], activation: str, dtype: torch.dtype
) -> QuantizedLinear | None:
    """The fused product of ``linears``, each carrying a ``quantized`` weight (the loader sets
    it). Parts that cannot run as one quantized product (a float part beside quantized ones,
    or parts of different modes or group sizes, as a GGUF mixing Q4_0 with Q8_0 or a K-quant
    gives) are dequantized into their ``weight`` instead, with a warning, and None is
    returned: the caller builds the float product, so the model loads and runs at the float
    size for that product."""
    parts = [getattr(lin, "quantized", None) for lin in linears]
    kinds = {(p.mode, p.group_size) if p is not None else None for p in parts}
    if len(kinds) == 1 and None not in kinds:
        weight = concat([p for p in parts if p is not None])
        return QuantizedLinear(weight, _fused_bias(linears), activation, dtype)
    log.warning(
        "a fused product mixes %s: its quantized parts are dequantized to %s",
        sorted(str(k) for k in kinds),
        dtype,
    )
    for lin, part in zip(linears, parts, strict=True):
        if part is not None:
            lin.weight = nn.Parameter(part.dequantize(dtype), requires_grad=False)
            del lin.quantized
    return None


def _fused_bias(linears: Sequence[nn.Linear]) -> torch.Tensor | None:
    biases = [lin.bias for lin in linears]
    if all(b is None for b in biases):
        return None
    return torch.cat(
        [
            b.detach() if b is not None else torch.zeros(lin.out_features)
            for lin, b in zip(linears, biases, strict=True)
        ]
    )


def resident_weight_bytes(model: nn.Module) -> int:
    """Bytes the model's weights hold in memory: parameters and buffers (packed and quantized
    weights, scales), each storage once (a tied head counts once)."""
    # By storage: an fp32 tied head is a second tensor over the embedding's storage. oneDNN's
    # packed weights are opaque (no storage to ask), so they count by tensor identity.
    seen: set[tuple[str, int]] = set()
    total = 0
    for t in [*model.parameters(), *model.buffers()]:
        if t is None or t.device.type == "meta":
            continue
        try:
            storage = t.untyped_storage()
            key, size = ("storage", storage.data_ptr()), storage.nbytes()
        except (RuntimeError, NotImplementedError):
            key, size = ("tensor", id(t)), t.numel() * t.element_size()
        if key not in seen:
            seen.add(key)
            total += size
    return total


def quantized_kernels(model: nn.Module) -> list[str]:
    """The kernels the model's quantized products run, sorted (empty when none)."""
    return sorted({m.kernel for m in model.modules() if isinstance(m, QuantizedLinear)})
