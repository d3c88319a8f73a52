"""A decode step's decoder layers in one C call (``decode_chain.c``), for every layer of
the kit (``quanta.runner.layers``) whose ``decode_chain_blocker`` finds nothing it cannot
compute: each layer's options (norm kind, q/k norms, sliding window, soft-cap, attention
scale, sandwich norms, MLP kind, rotated features) are flags of its row in the table.

Once the panel kernel streamed a batch-1 step's weights near memory speed, what was left of
the step was Python: each of SmolLM2-135M's 30 layers dispatched some 27 torch operators and
ctypes calls (norms, product, rotary, two K/V stores, attention, product, norm, two products,
SiLU * up), a few microseconds each (profile in ``docs/results/benchmarks.md``). The chain runs the
same kernels in the same order from C, so its values are bit for bit those of the layer-by-
layer path, and only the dispatch between them goes.

It takes a step when the layer-by-layer path would run nothing else: every row a decode row
of a KV sequence (no prefill chunk, no hidden cache), bf16, and every projection a panel
product (bf16, int8 codes through ``native-int8`` or int4 codes through ``native-int4``).
Anything else (fp32, oneDNN or torch products, torch's int4 kernel, tensor-parallel ranks,
CUDA) keeps the layer-by-layer path, which stays the reference. Layer safepoints are kept:
the chain runs the layers between two checks in one call. ``QUANTA_DECODE_CHAIN=0`` turns it
off (the engine's log and ``quanta_engine_info`` name the path that runs).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
import struct
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from torch import nn

from quanta.runner import native_decode, panel_linear
from quanta.runner.attention import AttentionMetadata
from quanta.runner.layer_ops import NativeLayerOps, TorchLayerOps
from quanta.runner.layers.mlp import GatedMLP
from quanta.runner.layers.norms import LayerNorm
from quanta.runner.linear import PanelLinear
from quanta.runner.models.safepoints import Safepoints

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("decode_chain.c")
FLAGS = ("-O2", "-shared", "-fPIC")
# 8-byte slots per layer in the table ``decode_chain.c`` reads (``struct layer``): four norms
# (weight, bias), q/k norm weights, (packed weight, scales, bias, kind, group) for q/k/v, o,
# gate/up and down, four int64 flags, four doubles.
LAYER_SLOTS = 38
# ``struct product``'s kind: which panel kernel reads the weight
_KINDS = {"native": 0, "native-int8": 1, "native-int4": 2}
# ``struct layer``'s norm_kind and mlp_kind
NORM_RMS, NORM_RMS_OFFSET, NORM_LAYER = 0, 1, 2
_GATED_MLPS = {"silu": 0, "gelu_pytorch_tanh": 1}
_PLAIN_MLPS = {"relu": 2}
ENABLE_ENV = "QUANTA_DECODE_CHAIN"
# The parts of a step the chain times when asked (``DecodeChain.timings``), in the order of
# ``decode_chain.c``'s T_* slots.
PARTS = ("norms", "qkv", "qk_norm+rope", "kv_store", "attention", "o", "up", "activation",
         "down")  # fmt: skip


def enabled() -> bool:
    """Whether ``QUANTA_DECODE_CHAIN`` leaves the chain on (it is unless set to 0/false/off)."""
    return os.environ.get(ENABLE_ENV, "1").strip().lower() not in ("0", "false", "off", "no")


class DecodeChain:
    """The layers of one model, laid out for ``quanta_decode_chain``."""

    def __init__(
        self,
        fn: ctypes._CFuncPtr,
        kernels: Sequence[int],
        layers: Sequence[int],
        shape: Sequence[int],
        keep: Sequence[torch.Tensor],
    ) -> None:
        self._fn = fn
        self._kernels = (ctypes.c_int64 * len(kernels))(*kernels)
        self._layers = (ctypes.c_int64 * len(layers))(*layers)
        self._shape = (ctypes.c_int64 * len(shape))(*shape)
        self.num_layers = len(layers) // LAYER_SLOTS
        self._keep = tuple(keep)  # the tensors whose addresses the table holds
        # Seconds per part (``PARTS``) that each step adds to, while a profile sets it.
        self.timings: torch.Tensor | None = None

    def takes(self, x: torch.Tensor, meta: AttentionMetadata) -> bool:
        """Whether this step is one the chain runs (see the module docstring)."""
        decode = meta.decode
        return (
            decode is not None
            and not meta.prefills
            and meta.hidden is None
            and meta.kv_rows is None
            and len(decode.lens) == x.shape[0]
            and x.dtype == torch.bfloat16
            and x.is_contiguous()
        )

    def run(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        safepoints: Safepoints | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(last layer's MLP output, residual stream)`` of the embedded rows ``x``, which
        are overwritten; the layers between two safepoints run in one call."""
        residual = torch.empty_like(x)
        last = self.num_layers
        if safepoints is None:
            self._call(x, residual, 0, last, rope, kv_cache, meta)
            return x, residual
        # The checks ``walk_layers`` makes: before the first layer, then after every
        # ``interval`` layers but the last.
        every = safepoints.interval
        safepoints.check(0)
        for first in range(0, last, every):
            done = min(first + every, last)
            self._call(x, residual, first, done, rope, kv_cache, meta)
            if done < last:
                safepoints.check(done)
        return x, residual

    def _call(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        first: int,
        last: int,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> None:
        decode = meta.decode
        assert decode is not None and kv_cache.is_contiguous()
        # held here: C reads them through their addresses for the whole call
        cos, sin = (None, None) if rope is None else (rope[0].contiguous(), rope[1].contiguous())
        layer_stride, value_offset = kv_cache.stride(0), kv_cache.stride(1)
        status = self._fn(
            self._kernels,
            self._layers,
            first,
            last,
            self._shape,
            x.data_ptr(),
            residual.data_ptr(),
            int(first == 0),
            None if cos is None else cos.data_ptr(),
            None if sin is None else sin.data_ptr(),
            kv_cache.data_ptr(),
            layer_stride,
            value_offset,
            meta.slot_mapping.data_ptr(),
            decode.slots.data_ptr(),
            decode.bounds.data_ptr(),
            x.shape[0],
            torch.get_num_threads(),
            None if self.timings is None else self.timings.data_ptr(),
        )
        if status == -1:
            raise MemoryError("the decode chain could not allocate its scratch space or sums")
        if status != 0:
            raise MemoryError("native decode attention could not allocate its scratch space")


@contextlib.contextmanager
def layer_by_layer(model: nn.Module) -> Iterator[None]:
    """Run ``model``'s decode steps layer by layer inside the block (profiling the parts, or
    timing the path the chain replaced); models without a chain are left as they are."""
    use = getattr(model, "use_decode_chain", None)
    if use is None:
        yield
        return
    chain = model.decoder.chain  # type: ignore[union-attr]
    use(None)
    try:
        yield
    finally:
        use(chain)


def build(model: nn.Module, ops: TorchLayerOps, attention_kernel: str) -> DecodeChain | None:
    """The chain of a loaded, fused kit ``model``, or None (with the reason at debug
    level) where some part runs a kernel the chain does not call."""
    reason = _unsupported(model, ops, attention_kernel)
    if reason:
        log.debug("decode chain not used: %s", reason)
        return None
    library = _library()
    if library is None:
        return None
    panel = panel_linear.load()
    attend = native_decode.load()
    assert panel is not None and isinstance(ops, NativeLayerOps)
    addresses = ops.addresses
    if attend is None or addresses is None:
        return None
    norm, norm_offset, layer_norm, rope, silu_mul, gelu_tanh_mul, relu = addresses
    kernels = (*panel.addresses, norm, norm_offset, layer_norm, rope, attend.address, silu_mul,
               gelu_tanh_mul, relu)  # fmt: skip
    table: list[int] = []
    keep: list[torch.Tensor] = []
    layers = model.decoder.layers  # type: ignore[union-attr]
    for layer in layers:
        table += _layer_row(layer, keep)
    config = model.config  # type: ignore[union-attr]
    attn = layers[0].self_attn
    shape = (
        config.hidden_size,
        attn.num_heads,
        attn.num_kv_heads,
        attn.head_dim,
        layers[0].mlp.down_proj.in_features,
    )
    return DecodeChain(library, kernels, table, shape, keep)


def _layer_row(layer: nn.Module, keep: list[torch.Tensor]) -> list[int]:
    """``layer``'s row of the table (``struct layer``); the tensors it points at are added to
    ``keep``."""

    def address(t: torch.Tensor | None) -> int:
        if t is None:
            return 0
        keep.append(t)
        return t.data_ptr()

    attn, mlp = layer.self_attn, layer.mlp
    row: list[int] = []
    for norm in _layer_norms(layer):
        row += [address(norm.weight), address(getattr(norm, "bias", None))]
    if not getattr(layer, "sandwich", False):
        row += [0, 0, 0, 0]
    for name in ("q_norm", "k_norm"):
        row.append(address(getattr(attn, name).weight) if attn.qk_norm else 0)
    for proj in _products(layer):
        spec = _product(proj)
        assert spec is not None
        tensors, kind, group = spec
        row += [address(t) for t in tensors] + [kind, group]
    norm = layer.norms[0]
    kind = _mlp_kind(mlp)
    assert kind is not None
    row += [_norm_kind(norm), kind, attn.rotary_dim, attn.window]
    doubles = (norm.eps, getattr(norm, "offset", 0.0), attn.scale, attn.softcap or 0.0)
    return row + [struct.unpack("<q", struct.pack("<d", value))[0] for value in doubles]


# ``struct layer``'s norms in order; the sandwich ones only where the layer has them
_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
          "post_feedforward_layernorm")  # fmt: skip


def _layer_norms(layer: nn.Module) -> list[nn.Module]:
    """The layer's norms in table order: the two before attention and MLP, and Gemma 2's
    sandwich ones after them."""
    norms = list(layer.norms)
    if layer.sandwich:
        norms += [layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm]
    return norms


def _norm_kind(norm: nn.Module) -> int:
    if isinstance(norm, LayerNorm):
        return NORM_LAYER
    return NORM_RMS_OFFSET if norm.offset else NORM_RMS


def _mlp_kind(mlp: nn.Module) -> int | None:
    """``struct layer``'s mlp_kind of ``mlp``, or None where the chain does not compute it."""
    kinds = _GATED_MLPS if isinstance(mlp, GatedMLP) else _PLAIN_MLPS
    return kinds.get(mlp.activation)


def _products(layer: nn.Module) -> tuple[nn.Module, ...]:
    """q/k/v, o, gate/up (a plain MLP's up) and down: the table's four products."""
    attn, mlp = layer.self_attn, layer.mlp
    up = mlp.gate_up_proj if isinstance(mlp, GatedMLP) else mlp.up_proj
    return attn.qkv_proj, attn.o_proj, up, mlp.down_proj


def _unsupported(model: nn.Module, ops: TorchLayerOps, attention_kernel: str) -> str | None:
    """Why ``model`` cannot run through the chain, or None when it can."""
    if attention_kernel != "native":
        return f"decode attention is {attention_kernel}"
    if not isinstance(ops, NativeLayerOps) or ops.addresses is None:
        return "the layer ops are torch's"
    layers = getattr(getattr(model, "decoder", None), "layers", None)
    if not layers or not all(hasattr(layer, "decode_chain_blocker") for layer in layers):
        return "not a decoder of the layer kit"
    config = model.config  # type: ignore[union-attr]
    for i, layer in enumerate(layers):
        blocker = layer.decode_chain_blocker()
        if blocker:
            return f"layer {i}: {blocker}"
        attn, mlp = layer.self_attn, layer.mlp
        norms = _layer_norms(layer)
        qk_norms = [attn.q_norm, attn.k_norm] if attn.qk_norm else []
        if any(n.weight is None for n in norms):
            return f"layer {i}'s norms have no weight"
        if any(n.weight.dtype != torch.bfloat16 for n in norms + qk_norms):
            return f"layer {i}'s norms are not bf16"
        if len({(_norm_kind(n), getattr(n, "offset", 0.0)) for n in norms}) != 1:
            return f"layer {i}'s norms differ in kind or offset"
        if any(n.eps != norms[0].eps for n in norms + qk_norms):
            return f"layer {i}'s norms differ in eps"
        if any(_norm_kind(n) != NORM_RMS for n in qk_norms):
            return f"layer {i}'s q/k norms are not LLaMA's RMSNorm"
        if _mlp_kind(mlp) is None:
            return f"layer {i}'s MLP runs {mlp.activation}"
        if (attn.num_heads, attn.num_kv_heads, attn.head_dim) != (
            config.num_heads,
            config.num_kv_heads,
            config.head_dim,
        ):
            return f"layer {i}'s heads are a shard of the model's"
        products = _products(layer)
        if any(_product(proj) is None for proj in products):
            return f"layer {i} runs {type(products[0]).__name__} products"
        if getattr(products[2], "activation", "none") not in ("none", mlp.activation):
            return f"layer {i}'s first MLP product applies another activation"
    return None


_Tensors = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]


def _product(proj: nn.Module) -> tuple[_Tensors, int, int] | None:
    """((packed weight, scales or None, bias or None), kind, group size) of a panel product,
    or None for any other. A product's ReLU (a plain MLP's first) is the chain's own step,
    as exact as the one the product runs after its kernel."""
    if getattr(proj, "activation", None) not in ("none", "relu"):
        return None
    if isinstance(proj, PanelLinear):
        return (proj.packed_weight, None, proj.bias), _KINDS["native"], 0
    kernel = getattr(proj, "kernel", None)
    if kernel in ("native-int8", "native-int4"):
        group = proj.group_size if kernel == "native-int4" else 0
        return (proj.qweight, proj.scales, proj.bias), _KINDS[kernel], group  # type: ignore[return-value]
    return None


@functools.cache
def _library() -> ctypes._CFuncPtr | None:
    library = native_decode.load_library(SOURCE, FLAGS, "the decode chain")
    if library is None:
        return None
    fn = library.quanta_decode_chain
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    fn.argtypes = [p, p, i64, i64, p, p, p, ctypes.c_int, p, p, p, i64, i64, p, p, p, i64,
                   ctypes.c_int, p]  # fmt: skip
    fn.restype = ctypes.c_int
    return fn
