"""The small operations of a LLaMA decoder layer: residual add + RMSNorm, rotary embedding,
SiLU * up. Two implementations with one meaning.

At batch 1 a decode step of SmolLM2-135M (30 layers) spent about a third of its time outside
the weight products, most of it dispatching small operators: RMSNorm alone is eight torch
operators on a 576-wide row, rotary embedding fourteen, and each costs microseconds of dispatch
whatever its size (profile in ``docs/results/benchmarks.md``).

``NativeLayerOps`` runs the residual add + RMSNorm, the rotary embedding and SiLU * up each
as one call into a C kernel (``layer_ops.c``, built at load like the decode-attention
kernel): 6-9 us against 24-35 us for the torch operators on one row. SiLU's ``exp`` is
glibc's vector one (libmvec): a scalar ``expf`` loop was slower than torch's four operators,
so where libmvec is missing SiLU * up stays torch's. ``TorchLayerOps`` is the same arithmetic
in torch operators, for devices and machines without the kernel.

Both round where HF transformers' eager model rounds: in bf16 the residual add, the normalised
row before the weight, each product and sum of the rotation are rounded, as torch
rounds each bf16 operator; in fp32 nothing is rounded between operations. They differ from
each other only in the order the RMSNorm's sum of squares is added up (the last bits of an
fp32 mean).
"""

from __future__ import annotations

import ctypes
import logging
import subprocess
from pathlib import Path

import torch
import torch.nn.functional as F

from quanta.runner import native_decode

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("layer_ops.c")
# No -fassociative-math and no FMA contraction: every operation rounds as torch's does; the
# one reduction vectorises through its `omp simd reduction` mark.
FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-ffp-contract=off", "-fopenmp-simd",
         "-shared", "-fPIC")  # fmt: skip
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}


class TorchLayerOps:
    """The layer's small operations as torch operators (HF's own sequence)."""

    name = "torch"

    def rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """``weight * normalise(residual + x)``; the sum is written into ``residual``. With
        ``residual`` None, ``weight * normalise(x)``."""
        if residual is not None:
            x = residual.add_(x)
        # NOTE: normalise in fp32 and cast back before the weight, exactly like HF.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return weight * h.to(x.dtype)

    def rope_(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Rotate ``qk`` ``[T, heads, D]`` (a view into the fused product) in place by
        ``cos``/``sin`` ``[T, D]``."""
        cos, sin = cos[:, None, :], sin[:, None, :]
        qk.copy_(qk * cos + rotate_half(qk) * sin)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of the fused ``[T, 2 * inner]`` product."""
        inner = gate_up.shape[1] // 2
        return F.silu(gate_up[:, :inner]) * gate_up[:, inner:]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class NativeLayerOps(TorchLayerOps):
    """The same operations, each one call into ``layer_ops.c``; layouts it cannot read (not
    contiguous rows, other dtypes) go through the torch operators."""

    name = "native"

    def __init__(self, library: ctypes.CDLL) -> None:
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        self._norm = library.quanta_add_rms_norm
        self._norm.argtypes = [p, p, p, p, i64, i64, ctypes.c_float, ctypes.c_int]
        self._norm.restype = None
        self._rope = library.quanta_rope
        self._rope.argtypes = [p, p, p, i64, i64, i64, i64, ctypes.c_int]
        self._rope.restype = None
        self._silu_mul = None
        if library.quanta_silu_mul_available():
            self._silu_mul = library.quanta_silu_mul
            self._silu_mul.argtypes = [p, p, i64, i64, ctypes.c_int]
            self._silu_mul.restype = None

    @property
    def addresses(self) -> tuple[int, int, int] | None:
        """The norm, rotary and SiLU * up C entry points (``decode_chain`` calls them
        directly); None where SiLU * up is torch's (no libmvec)."""
        if self._silu_mul is None:
            return None
        address = native_decode.c_address
        return address(self._norm), address(self._rope), address(self._silu_mul)

    def rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        target = x if residual is None else residual
        code = _DTYPE_CODES.get(x.dtype)
        if (
            code is None
            or x.device.type != "cpu"
            or weight.dtype != x.dtype
            or not (x.is_contiguous() and target.is_contiguous() and target.dtype == x.dtype)
        ):
            return super().rms_norm(x, residual, weight, eps)
        out = torch.empty_like(target)
        rows, dim = target.shape
        self._norm(
            out.data_ptr(),
            target.data_ptr(),
            None if residual is None else x.data_ptr(),
            weight.data_ptr(),
            rows,
            dim,
            eps,
            code,
        )
        return out

    def rope_(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        tokens, heads, dim = qk.shape
        code = _DTYPE_CODES.get(qk.dtype)
        if (
            code is None
            or qk.device.type != "cpu"
            or qk.stride()[1:] != (dim, 1)
            or not (cos.dtype == sin.dtype == qk.dtype)
            or not (cos.is_contiguous() and sin.is_contiguous())
        ):
            super().rope_(qk, cos, sin)
            return
        self._rope(
            qk.data_ptr(), cos.data_ptr(), sin.data_ptr(), tokens, heads, dim, qk.stride(0), code
        )

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        code = _DTYPE_CODES.get(gate_up.dtype)
        if (
            self._silu_mul is None
            or code is None
            or gate_up.device.type != "cpu"
            or gate_up.dim() != 2
            or not gate_up.is_contiguous()
        ):
            return super().silu_mul(gate_up)
        rows, width = gate_up.shape
        out = torch.empty(rows, width // 2, dtype=gate_up.dtype)
        self._silu_mul(out.data_ptr(), gate_up.data_ptr(), rows, width // 2, code)
        return out


def layer_ops(device: torch.device) -> TorchLayerOps:
    """``NativeLayerOps`` on CPU where the C kernel builds, else ``TorchLayerOps`` (with a
    warning where a CPU build failed: slower, never broken)."""
    cc = native_decode.compiler()
    if device.type != "cpu" or cc is None:
        return TorchLayerOps()
    try:
        try:
            path = native_decode.build(SOURCE, FLAGS, cc, libs=("-lmvec",))
        except subprocess.CalledProcessError:  # no libmvec (not glibc): SiLU stays torch's
            path = native_decode.build(SOURCE, (*FLAGS, "-DQUANTA_NO_LIBMVEC"), cc)
        return NativeLayerOps(ctypes.CDLL(str(path)))
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("building the native layer ops failed: %s", getattr(exc, "stderr", "") or exc)
        return TorchLayerOps()
