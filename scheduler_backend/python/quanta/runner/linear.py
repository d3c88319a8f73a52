"""Linear layers as the engine runs them: projections fused at load, through prepacked oneDNN
weights on CPU where that runs the dtype.

torch's ``F.linear`` re-lays the weight out for its GEMM on every call. oneDNN can reorder the
weight once, at load, into the blocked layout its kernels read (AVX-512, AVX512_BF16 or AMX,
whichever the CPU has), and each step then runs the kernel directly. Measured on an OPT-125M
layer, one thread (``docs/results/benchmarks.md``): 1.2-2x faster in fp32 and 1.3-2.2x in bf16
at 1-32 rows, and never slower at 512 rows. The rule (not a timing at start-up, which would make two
replicas of one model round differently on a noisy machine): ``auto`` packs on CPU whenever
torch's oneDNN build can run the dtype, and keeps ``F.linear`` elsewhere (CUDA, fp16 on CPU).
In fp32 oneDNN's product now reads the weight as stored: on an AMX machine that was as fast as
the blocked copy from 8 rows up and faster at one row (``PackedLinear``).

Projections that read the same input are fused into one product at load (q, k and v; LLaMA's
gate and up), and the residual add and ReLU ride on the product as oneDNN post-ops: a decode
step of a small model is dozens of products that each stream their weight once, so fewer,
wider calls save both the per-call dispatch and a pass over the output (measured in
``docs/results/benchmarks.md``). Checkpoints keep HF's separate names; models load them into plain
``nn.Linear`` modules and ``fuse`` replaces those with ``Projection``s afterwards.

In bf16 on a CPU with AVX512_BF16, ``auto`` picks ``native``: the panel kernel of
``panel_linear.py``, which streams a one-row product's weight at memory speed where oneDNN's
reached two thirds of it, and matches oneDNN at prefill sizes.

Packing keeps only the packed weight, so memory does not double. A head tied to the embedding
is the exception in bf16: the embedding table must stay for the lookup, so the packed head is a
second copy (``vocab x hidden``), stated in ``describe``; an fp32 head reads the table itself.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from quanta.core.config import LinearKernel
from quanta.runner import fp32_rows, panel_linear
from quanta.runner.projection import Projection

# Activations a product can apply as a oneDNN post-op, bit-identical to the eager op in fp32.
_FUSABLE_ACTIVATIONS = ("none", "relu")
# fp32 products of at most this many rows go through torch's own GEMM (MKL) on the stored
# weight, which streams it faster than oneDNN there: an OPT-125M decode step's layer products
# in 24.3 ms against 27.6 at one row, 27.1 against 40.3 at two, 28.8 against 45.2 at three,
# and 49.3 against 40.7 at four (one thread, weights out of cache, best of 7 alternating).
# A row's last bits depend on how many rows share its product either way (oneDNN's fp32
# kernels already differ between batch sizes); greedy tokens equal HF's as before.
_FP32_FEW_ROWS = 3


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
    """``torch``, ``onednn`` or ``native`` for this dtype and device; asking for a kernel
    where it cannot run is an error, not a silent fallback."""
    supported = onednn_supports(dtype, device)
    if kernel == "onednn" and not supported:
        raise ValueError(
            f"linear_kernel=onednn needs a CPU whose oneDNN runs {dtype} "
            f"(this is {device.type}); use auto or torch"
        )
    if kernel == "native" and not panel_linear.supports(dtype, device):
        raise ValueError(
            f"linear_kernel=native needs bf16 on a CPU with AVX512_BF16 and a C compiler "
            f"(this is {dtype} on {device.type}); use auto, onednn or torch"
        )
    if kernel == "auto":
        if panel_linear.supports(dtype, device):
            return "native"
        return "onednn" if supported else "torch"
    return kernel


class TorchLinear(Projection):
    """``F.linear``: the kernel where oneDNN does not run the dtype (CUDA, fp16 on CPU)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, activation: str) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.activation = activation
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        return torch.relu_(y) if self.activation == "relu" else y

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias).add_(residual)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, torch"


class PackedLinear(Projection):
    """oneDNN's product, the activation and residual add as post-ops; the weight in oneDNN's
    blocked layout in bf16 and fp16, as stored in fp32, where products of up to 64 rows (a
    decode step, a short prefill chunk) run through the few-rows kernel on it instead
    (``quanta.runner.fp32_rows``), or where that kernel cannot be built through ``F.linear``
    (MKL, up to ``_FP32_FEW_ROWS``).

    fp32 keeps one copy of the weight, as stored: oneDNN's blocked copy streamed it slower at
    one row (10.8 against 13 GB/s; an OPT-125M decode step's layer products 34 against 28 ms)
    and was level from 12 rows up, and a tied head reads the embedding's own table. The
    few-rows kernel is faster than either up to 64 rows; oneDNN keeps larger products."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, activation: str) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.activation = activation
        self._rows: fp32_rows.Fp32Rows | None = None
        if weight.dtype == torch.float32:
            packed = weight.contiguous()
            self._rows = fp32_rows.load() if weight.device.type == "cpu" else None
        else:
            packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        self.register_buffer("packed_weight", packed)
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._few_fp32_rows(x):
            return self._few(x)
        return torch.ops.mkldnn._linear_pointwise(
            x, self.packed_weight, self.bias, self.activation, [], ""
        )

    def _few_fp32_rows(self, x: torch.Tensor) -> bool:
        if self.packed_weight.dtype != torch.float32:
            return False
        rows = self._rows.max_rows if self._rows is not None else _FP32_FEW_ROWS
        return x.numel() <= rows * self.in_features

    def _few(self, x: torch.Tensor) -> torch.Tensor:
        """An fp32 product of a few rows: the few-rows kernel where it runs, else MKL."""
        relu = self.activation == "relu"
        if self._rows is not None and x.numel() > 0:
            rows = x.reshape(-1, self.in_features)
            y = self._rows.product(rows, self.packed_weight, self.bias, relu)
            return y.view(*x.shape[:-1], self.out_features)
        y = F.linear(x, self.packed_weight, self.bias)
        return torch.relu_(y) if relu else y

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        assert self.activation == "none", "a residual projection has no activation"
        if self._few_fp32_rows(x):
            return self._few(x).add_(residual)
        if self.packed_weight.dtype != torch.float32:
            # NOTE: in bf16 the product is rounded before the add, as HF and F.linear do.
            # oneDNN's fused add post-op rounds differently, and on a real model whose residual
            # stream reaches 10^4 (SmolLM2) that flipped greedy answers against HF's bf16 ones
            # ("Paris" became noise); in fp32 the post-op is bit-identical and stays fused.
            return self(x).add_(residual)
        return torch.ops.mkldnn._linear_pointwise.binary(
            x, residual.contiguous(), self.packed_weight, self.bias, "add"
        )

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, oneDNN"


class PanelLinear(Projection):
    """bf16 products through the panel kernel: the weight packed once, one copy."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        activation: str,
        library: panel_linear.PanelLibrary,
    ) -> None:
        super().__init__()
        if weight.dtype != torch.bfloat16 or (bias is not None and bias.dtype != weight.dtype):
            raise ValueError(f"the panel kernel runs bf16 weights, not {weight.dtype}")
        self.out_features, self.in_features = weight.shape
        self.activation = activation
        self._library = library
        self.register_buffer("packed_weight", library.pack(weight))
        self.register_buffer("bias", None if bias is None else bias.detach().contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        relu = self.activation == "relu"
        return self._library.product(x, self.packed_weight, self.bias, self.out_features, relu=relu)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        # The product is rounded to bf16 before the add, as HF's bf16 linear + add round.
        return self(x).add_(residual)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, native"


class ProjectionFactory:
    """Builds the engine's projections for one kernel: ``make([q, k, v])`` is one product whose
    output columns are q's, then k's, then v's."""

    def __init__(self, kernel: str) -> None:
        if kernel not in ("torch", "onednn", "native"):
            raise ValueError(f"unknown linear kernel {kernel!r}")
        self.kernel = kernel
        self._library = panel_linear.load() if kernel == "native" else None
        if kernel == "native" and self._library is None:
            raise ValueError("linear_kernel=native: the panel kernel does not run here")

    def __call__(self, linears: Sequence[nn.Linear], activation: str = "none") -> Projection:
        if activation not in _FUSABLE_ACTIVATIONS:
            raise ValueError(f"activation {activation!r} cannot be fused into a product")
        if any(hasattr(lin, "quantized") for lin in linears):  # set by the loader
            from quanta.runner.quantized import make_quantized

            product = make_quantized(linears, activation, linears[0].weight.dtype)
            if product is not None:
                return product
        weights = [lin.weight.detach() for lin in linears]
        weight = weights[0] if len(weights) == 1 else torch.cat(weights)
        biases = [lin.bias for lin in linears]
        bias = None
        if any(b is not None for b in biases):
            bias = torch.cat(
                [
                    b.detach() if b is not None else weight.new_zeros(lin.out_features)
                    for lin, b in zip(linears, biases, strict=True)
                ]
            )
        if self._library is not None:
            return PanelLinear(weight, bias, activation, self._library)
        cls = PackedLinear if self.kernel == "onednn" else TorchLinear
        return cls(weight, bias, activation)


def fusable_activation(name: str) -> str:
    """The post-op for an HF activation name, or ``none`` when it must run on its own."""
    return name if name in _FUSABLE_ACTIVATIONS else "none"


def fuse_model(model: nn.Module, kernel: str) -> int:
    """Fuse the model's projections (its ``fuse``), then turn every linear left (LM head,
    OPT's project_in/out) into a ``Projection`` of the same kernel; returns how many
    ``nn.Linear`` modules were replaced."""
    make = ProjectionFactory(kernel)
    replaced = model.fuse(make)  # type: ignore[operator]
    # A quantized embedding reads a tied head's packed table: which product holds which table.
    products: dict[int, nn.Module] = {}
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                product = make([child])
                if getattr(child, "quantized", None) is not None:
                    products[id(child.quantized)] = product
                setattr(parent, name, product)
                replaced += 1
    from quanta.runner.quantized_table import quantize_embeddings

    quantize_embeddings(model, products)  # (none where the loader quantized no table)
    return replaced
