"""Linear layers through prepacked oneDNN weights on CPU.

torch's ``F.linear`` re-lays the weight out for its GEMM on every call. oneDNN can reorder the
weight once, at load, into the blocked layout its kernels read (AVX-512, AVX512_BF16 or AMX,
whichever the CPU has), and each step then runs the kernel directly. Measured on an OPT-125M
layer, one thread (``docs/benchmarks.md``): 1.2-2x faster in fp32 and 1.3-2.2x in bf16 at 1-32
rows, and never slower at 512 rows. The rule (not a timing at start-up, which would make two
replicas of one model round differently on a noisy machine): ``auto`` packs on CPU whenever
torch's oneDNN build can run the dtype, and keeps ``F.linear`` elsewhere (CUDA, fp16 on CPU).

Packing replaces each ``nn.Linear`` by a ``PackedLinear`` holding only the packed weight, so
memory does not double. A head tied to the embedding is the exception: the embedding table
must stay for the lookup, so the packed head is a second copy (``vocab x hidden``), stated in
``describe``.
"""

from __future__ import annotations

import torch
from torch import nn

from quanta.core.config import LinearKernel


def onednn_supports(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether prepacked oneDNN linears run here for ``dtype``."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return False


def resolve_kernel(kernel: LinearKernel, dtype: torch.dtype, device: torch.device) -> str:
    """``torch`` or ``onednn`` for this dtype and device; asking for oneDNN where it cannot
    run is an error, not a silent fallback."""
    supported = onednn_supports(dtype, device)
    if kernel == "onednn" and not supported:
        raise ValueError(
            f"linear_kernel=onednn needs a CPU whose oneDNN runs {dtype} "
            f"(this is {device.type}); use auto or torch"
        )
    if kernel == "auto":
        return "onednn" if supported else "torch"
    return kernel


class PackedLinear(nn.Module):
    """``y = x W^T + b`` with ``W`` in oneDNN's layout; ``x`` is ``[rows, in_features]``."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        weight = linear.weight.detach()
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(weight, None))
        bias = None if linear.bias is None else linear.bias.detach()
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, oneDNN"


def pack_linears(model: nn.Module) -> int:
    """Replace every ``nn.Linear`` of ``model`` by a ``PackedLinear``; returns how many."""
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, PackedLinear(child))
                replaced += 1
    return replaced
