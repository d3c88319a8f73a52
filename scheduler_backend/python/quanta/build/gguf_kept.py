"""GGUF quantized tensors kept as they are: Q8_0, Q4_0 and Q4_1 blocks repacked into the
layout of ``quanta.runner.quantized``, with no round trip through floats.

llama.cpp's blocks hold 32 weights of one row each (groups run along the input dimension):

- Q8_0: ``d`` (f16), 32 int8 ``q``; ``w = d * q``: int8, group 32, symmetric;
- Q4_0: ``d`` (f16), 16 bytes; ``w = d * (q - 8)``: int4, group 32, ``zero = 0``;
- Q4_1: ``d``, ``m`` (f16), 16 bytes; ``w = d * q + m``: int4, group 32, ``zero = m + 8 d``;

with byte ``j`` of a 4-bit block holding weight ``j`` in its low nibble and ``j + 16`` in its
high one. The codes and the f16 scales are copied exactly; only ``zero = m + 8 d`` is
computed (in float32, exact for f16 inputs). Since groups run along the input dimension, q's
and k's rows can be put back in HF's order (``unpermute_rope_rows``) codes and scales alike.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from quanta.runner.quantized import QuantizedWeight

# GGUF type -> the mode it is kept as.
KEEPABLE = {"Q8_0": "int8", "Q4_0": "int4", "Q4_1": "int4"}
_BLOCK = 32
_BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}


@dataclass
class GgufKept:
    """What a GGUF build kept quantized and what it dequantized, per tensor type; ``modes``,
    ``groups`` and ``symmetric`` describe the kept linears (a kept token embedding counts in
    ``kept`` only)."""

    kept: dict[str, int] = field(default_factory=dict)
    dequantized: dict[str, int] = field(default_factory=dict)
    modes: list[str] = field(default_factory=list)
    groups: list[int] = field(default_factory=list)
    symmetric: bool = True

    def count(self, type_name: str, kept: bool, linear: bool = True) -> None:
        counts = self.kept if kept else self.dequantized
        counts[type_name] = counts.get(type_name, 0) + 1
        if kept and linear:
            mode = KEEPABLE[type_name]
            if mode not in self.modes:
                self.modes.append(mode)
            if _BLOCK not in self.groups:
                self.groups.append(_BLOCK)
            self.symmetric = self.symmetric and type_name != "Q4_1"


def kept_weight(
    raw: np.ndarray,
    type_name: str,
    shape: tuple[int, int],
    permute_rows: Callable[[np.ndarray], np.ndarray] | None = None,
) -> QuantizedWeight:
    """A ``[out, in]`` weight of ``type_name`` from its raw GGUF bytes, rows optionally put
    back in HF's order by ``permute_rows`` (applied to codes, scales and zeros alike)."""
    out_features, in_features = shape
    if in_features % _BLOCK:
        raise ValueError(f"{type_name} rows of {in_features} are not whole blocks")
    groups = in_features // _BLOCK
    blocks = np.ascontiguousarray(raw).view(np.uint8).reshape(out_features, groups, -1)
    if blocks.shape[-1] != _BLOCK_BYTES[type_name]:
        raise ValueError(f"{type_name} blocks of {blocks.shape[-1]} bytes")
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    zeros: np.ndarray | None = None
    if type_name == "Q8_0":
        codes = blocks[..., 2:].copy().view(np.int8).reshape(out_features, in_features)
    else:
        start = 4 if type_name == "Q4_1" else 2
        qs = blocks[..., start:]
        codes = np.concatenate((qs & 0x0F, qs >> 4), axis=-1).reshape(out_features, in_features)
        if type_name == "Q4_1":
            m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
            zeros = m + 8 * d
    if permute_rows is not None:
        codes, d = permute_rows(codes), permute_rows(d)
        zeros = None if zeros is None else permute_rows(zeros)
    scales = torch.from_numpy(np.ascontiguousarray(d))
    zero_t = None if zeros is None else torch.from_numpy(np.ascontiguousarray(zeros))
    if type_name == "Q8_0":
        return QuantizedWeight("int8", torch.from_numpy(np.ascontiguousarray(codes)), scales, None)
    u = torch.from_numpy(np.ascontiguousarray(codes, dtype=np.uint8))
    packed = (u[:, 0::2] | (u[:, 1::2] << 4)).contiguous()
    return QuantizedWeight("int4", packed, scales, zero_t)
