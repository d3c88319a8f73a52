"""The small operations of a decoder layer: residual add + RMSNorm (LLaMA's, and Gemma's
``1 + weight``) or LayerNorm, rotary embedding, SiLU * up, GELU(tanh) * up, ReLU. Two
implementations with one meaning.

At batch 1 a decode step of SmolLM2-135M (30 layers) spent about a third of its time outside
the weight products, most of it dispatching small operators: RMSNorm alone is eight torch
operators on a 576-wide row, rotary embedding fourteen, and each costs microseconds of dispatch
whatever its size (profile in ``docs/results/benchmarks.md``).

``NativeLayerOps`` runs each of them as one call into a C kernel (``layer_ops.c``, built at
load like the decode-attention kernel): 6-9 us against 24-35 us for the torch operators on
one row. SiLU's ``exp`` is glibc's vector one (libmvec): a scalar ``expf`` loop was slower
than torch's four operators, so where libmvec is missing SiLU * up and GELU * up stay
torch's. ``TorchLayerOps`` is the same arithmetic in torch operators, for devices and
machines without the kernel. The decode chain (``quanta.runner.decode_chain``) calls the same
C functions, so both paths compute the same bits.

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
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        weight: torch.Tensor,
        eps: float,
        offset: float = 0.0,
    ) -> torch.Tensor:
        """``weight * normalise(residual + x)``; the sum is written into ``residual``. With
        ``residual`` None, ``weight * normalise(x)``. ``offset`` 1 is Gemma's
        ``(1 + weight)``."""
        if residual is not None:
            x = residual.add_(x)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        if offset:  # NOTE: Gemma scales in fp32 and casts after the weight, as HF does
            return (h * (offset + weight.float())).to(x.dtype)
        # NOTE: normalise in fp32 and cast back before the weight, exactly like HF.
        return weight * h.to(x.dtype)

    def layer_norm(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        eps: float,
    ) -> torch.Tensor:
        """``layer_norm(residual + x)`` with ``weight`` and ``bias`` (either may be None),
        the sum written into ``residual`` as ``rms_norm`` does."""
        if residual is not None:
            x = residual.add_(x)
        return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)

    def rope_(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Rotate ``qk`` ``[T, heads, D]`` (a view into the fused product; ``D`` may be a
        partial rotation's share of each head) in place by ``cos``/``sin`` ``[T, D]``."""
        cos, sin = cos[:, None, :], sin[:, None, :]
        qk.copy_(qk * cos + rotate_half(qk) * sin)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of the fused ``[T, 2 * inner]`` product."""
        inner = gate_up.shape[1] // 2
        return F.silu(gate_up[:, :inner]) * gate_up[:, inner:]

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``gelu_tanh(gate) * up`` of the fused ``[T, 2 * inner]`` product (GeGLU)."""
        inner = gate_up.shape[1] // 2
        return F.gelu(gate_up[:, :inner], approximate="tanh") * gate_up[:, inner:]

    def relu_(self, x: torch.Tensor) -> torch.Tensor:
        """``relu(x)``, in place."""
        return x.relu_()

    def store_kv_(
        self, cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """A step's ``k``, ``v`` ``[T, KVH, D]`` into the paged ``cache`` ``[2, slots, KVH,
        D]`` at ``slots`` ``[T]`` (in the cache's dtype)."""
        cache[0].index_copy_(0, slots, k.to(cache.dtype))
        cache[1].index_copy_(0, slots, v.to(cache.dtype))


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
        self._rope.argtypes = [p, p, p, i64, i64, i64, i64, i64, ctypes.c_int]
        self._rope.restype = None
        self._norm_offset = library.quanta_add_rms_norm_offset
        self._norm_offset.argtypes = [p, p, p, p, i64, i64, ctypes.c_float, ctypes.c_float,
                                      ctypes.c_int]  # fmt: skip
        self._norm_offset.restype = None
        self._layer_norm = library.quanta_add_layer_norm
        self._layer_norm.argtypes = [p, p, p, p, p, i64, i64, ctypes.c_float, ctypes.c_int]
        self._layer_norm.restype = None
        self._relu = library.quanta_relu_
        self._relu.argtypes = [p, i64, i64, ctypes.c_int]
        self._relu.restype = None
        self._store_kv = library.quanta_store_kv
        self._store_kv.argtypes = [p] * 5 + [i64] * 6
        self._store_kv.restype = i64
        self._silu_mul = self._gelu_tanh_mul = None
        if library.quanta_silu_mul_available():
            self._silu_mul = library.quanta_silu_mul
            self._gelu_tanh_mul = library.quanta_gelu_tanh_mul
            for fn in (self._silu_mul, self._gelu_tanh_mul):
                fn.argtypes = [p, p, i64, i64, ctypes.c_int]
                fn.restype = None

    @property
    def addresses(self) -> tuple[int, ...] | None:
        """The C entry points ``decode_chain`` calls directly: RMSNorm, Gemma's RMSNorm,
        LayerNorm, rotary, SiLU * up, GELU(tanh) * up, ReLU; None where the gated
        activations are torch's (no libmvec)."""
        if self._silu_mul is None or self._gelu_tanh_mul is None:
            return None
        fns = (self._norm, self._norm_offset, self._layer_norm, self._rope, self._silu_mul,
               self._gelu_tanh_mul, self._relu)  # fmt: skip
        return tuple(native_decode.c_address(fn) for fn in fns)

    def rms_norm(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        weight: torch.Tensor,
        eps: float,
        offset: float = 0.0,
    ) -> torch.Tensor:
        target = x if residual is None else residual
        code = _rows_code(x, target, weight)
        if code is None:
            return super().rms_norm(x, residual, weight, eps, offset)
        out = torch.empty_like(target)
        rows, dim = target.shape
        added = None if residual is None else x.data_ptr()
        if offset:
            self._norm_offset(out.data_ptr(), target.data_ptr(), added, weight.data_ptr(), rows,
                              dim, eps, offset, code)  # fmt: skip
        else:
            self._norm(out.data_ptr(), target.data_ptr(), added, weight.data_ptr(), rows, dim,
                       eps, code)  # fmt: skip
        return out

    def layer_norm(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        eps: float,
    ) -> torch.Tensor:
        target = x if residual is None else residual
        code = None if weight is None else _rows_code(x, target, weight)
        if code is None or (bias is not None and bias.dtype != x.dtype):
            return super().layer_norm(x, residual, weight, bias, eps)
        out = torch.empty_like(target)
        rows, dim = target.shape
        self._layer_norm(
            out.data_ptr(),
            target.data_ptr(),
            None if residual is None else x.data_ptr(),
            weight.data_ptr(),  # type: ignore[union-attr]
            None if bias is None else bias.data_ptr(),
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
            or qk.stride(2) != 1
            or qk.stride(1) < dim
            or not (cos.dtype == sin.dtype == qk.dtype)
            or not (cos.is_contiguous() and sin.is_contiguous())
        ):
            super().rope_(qk, cos, sin)
            return
        self._rope(qk.data_ptr(), cos.data_ptr(), sin.data_ptr(), tokens, heads, dim,
                   qk.stride(1), qk.stride(0), code)  # fmt: skip

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        out = self._gated(self._silu_mul, gate_up)
        return super().silu_mul(gate_up) if out is None else out

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        out = self._gated(self._gelu_tanh_mul, gate_up)
        return super().gelu_tanh_mul(gate_up) if out is None else out

    @staticmethod
    def _gated(kernel: ctypes._CFuncPtr | None, gate_up: torch.Tensor) -> torch.Tensor | None:
        """``act(gate) * up`` of ``[rows, 2 * width]`` through a C kernel, or None where the
        kernel is missing or the matrix is not one it reads (the caller falls back to torch)."""
        code = _matrix_code(gate_up)
        if kernel is None or code is None:
            return None
        rows, width = gate_up.shape
        out = torch.empty(rows, width // 2, dtype=gate_up.dtype)
        kernel(out.data_ptr(), gate_up.data_ptr(), rows, width // 2, code)
        return out

    def relu_(self, x: torch.Tensor) -> torch.Tensor:
        code = _matrix_code(x)
        if code is None:
            return super().relu_(x)
        self._relu(x.data_ptr(), x.shape[0], x.shape[1], code)
        return x

    def store_kv_(
        self, cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        if not _kv_rows(cache, slots, k, v):
            super().store_kv_(cache, slots, k, v)
            return
        tokens, heads, dim = k.shape
        bad = self._store_kv(cache[0].data_ptr(), cache[1].data_ptr(), k.data_ptr(),
                             v.data_ptr(), slots.data_ptr(), tokens, cache.shape[1],
                             heads * dim, k.stride(0), v.stride(0), k.element_size())  # fmt: skip
        if bad >= 0:
            raise IndexError(f"K/V slot {int(slots[bad])} outside the cache's {cache.shape[1]}")


def _kv_rows(cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether ``quanta_store_kv`` reads these: CPU tensors of the cache's dtype, each token's
    heads one run of elements (a view into the fused product is fine), the cache contiguous
    and the slots contiguous int64."""
    return (
        cache.device.type == "cpu"
        and k.device == v.device == slots.device == cache.device
        and cache.is_contiguous()
        and k.dtype == v.dtype == cache.dtype
        and slots.dtype == torch.int64
        and slots.is_contiguous()
        and k.shape == v.shape
        and k.shape[1:] == cache.shape[2:]
        and k.shape[0] == slots.shape[0]
        and all(t.stride(2) == 1 and t.stride(1) == t.shape[2] for t in (k, v))
    )


def _rows_code(x: torch.Tensor, target: torch.Tensor, weight: torch.Tensor) -> int | None:
    """The C kernels' dtype code for a norm of ``target`` (and the added ``x``), or None
    where they cannot read it."""
    code = _DTYPE_CODES.get(x.dtype)
    if (
        code is None
        or x.device.type != "cpu"
        or weight.dtype != x.dtype
        or not (x.is_contiguous() and target.is_contiguous() and target.dtype == x.dtype)
    ):
        return None
    return code


def _matrix_code(x: torch.Tensor) -> int | None:
    """The C kernels' dtype code for a contiguous ``[rows, width]`` CPU tensor, else None."""
    code = _DTYPE_CODES.get(x.dtype)
    if code is None or x.device.type != "cpu" or x.dim() != 2 or not x.is_contiguous():
        return None
    return code


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
