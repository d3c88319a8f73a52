"""What a card can do and what a model shape asks of it: the bounds a GPU run is read against.

A decode step must at least stream every weight it multiplies by and every K/V it attends
over, so its floor is those bytes over the card's memory bandwidth; a prefill must at least do
its model FLOPs at the card's GEMM rate. Both rates are measured on the card the run uses
(a device-to-device copy, a large bf16 matrix product), not taken from a datasheet, so each
ratio says how far the engine is from what this card did in the same minute.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from quanta.build.presets import ModelPreset, get_preset
from quanta.families import get_family

# Tables a step reads a few rows of, not stream: token embeddings (unless the LM head is the
# embedding) and OPT's learned positions.
_LOOKUP_TABLES = ("embed_tokens.weight", "embed_positions.weight")
_NOT_PER_TOKEN = (*_LOOKUP_TABLES, "lm_head.weight")


@dataclass(frozen=True, slots=True)
class Card:
    """A device's name and its two measured rates."""

    name: str
    bandwidth: float  # bytes/s a device-to-device copy moves, counting bytes read and written
    gemm_flops: float  # FLOP/s of a square matrix product in the run's dtype


def measure_card(
    device: torch.device, dtype: torch.dtype, *, copy_mib: int = 1024, gemm_n: int = 8192
) -> Card:
    """The copy bandwidth and GEMM rate of ``device``: medians of timed repeats after warm-up
    (a copy of ``copy_mib`` MiB; an ``n x n x n`` product of random values)."""
    copy_s = _copy_seconds(device, copy_mib << 20)
    a = torch.randn(gemm_n, gemm_n, device=device).to(dtype)
    b = torch.randn(gemm_n, gemm_n, device=device).to(dtype)
    gemm_s = _median_seconds(device, lambda: a @ b)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return Card(name, 2 * (copy_mib << 20) / copy_s, 2 * gemm_n**3 / gemm_s)


def _copy_seconds(device: torch.device, nbytes: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return _median_seconds(device, lambda: dst.copy_(src))


def _median_seconds(device: torch.device, fn: Callable[[], object], repeats: int = 10) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def synchronize(device: torch.device) -> None:
    """Wait for the device, so a host clock times the work and not its launch."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass(frozen=True, slots=True)
class ShapeCost:
    """What one model shape costs per step, in the run's dtype."""

    weight_bytes: int  # weights a decode step streams (the LM head once, lookup tables not)
    kv_bytes_per_token: int  # K and V of one token over every layer
    matmul_params: int  # weights every prompt token is multiplied by (the LM head aside)
    head_params: int  # the LM head's, multiplied by one row per sequence in a prefill
    num_layers: int
    attention_width: int  # query heads x head_dim

    @classmethod
    def of(cls, preset: str | ModelPreset, dtype: torch.dtype) -> ShapeCost:
        spec = get_preset(preset)
        size = torch.empty((), dtype=dtype).element_size()
        specs = get_family(spec.family).tensor_specs(spec)
        tensors = {name: math.prod(shape) for name, shape, _ in specs}
        tables = sum(n for name, n in tensors.items() if name.endswith(_LOOKUP_TABLES))
        embedding = next(n for name, n in tensors.items() if name.endswith(_LOOKUP_TABLES[0]))
        # NOTE: a tied head is not stored (as save_pretrained): it is the embedding, streamed
        head = tensors.get("lm_head.weight")
        streamed = sum(tensors.values()) - tables + (embedding if head is None else 0)
        matmuls = sum(n for name, n in tensors.items() if not name.endswith(_NOT_PER_TOKEN))
        shape = spec.shape
        return cls(
            weight_bytes=streamed * size,
            kv_bytes_per_token=shape.kv_bytes_per_token(size),
            matmul_params=matmuls,
            head_params=embedding if head is None else head,
            num_layers=shape.num_layers,
            attention_width=shape.num_heads * shape.head_dim,
        )

    def decode_bound_s(self, batch: int, context: float, bandwidth: float) -> float:
        """The fastest a decode step of ``batch`` sequences of ``context`` tokens can be: its
        weights and every sequence's K/V read once, at ``bandwidth``. (A copy's rate counts
        bytes read and written; a step mostly reads, so this floor is, if anything, low.)"""
        return (self.weight_bytes + batch * context * self.kv_bytes_per_token) / bandwidth

    def prefill_flops(self, batch: int, prompt_len: int) -> float:
        """Model FLOPs of prefilling ``batch`` prompts: every token through every matrix, the
        causal attention's two products, and the LM head for each prompt's last token."""
        attention = 2 * self.num_layers * self.attention_width * prompt_len * prompt_len
        per_prompt = 2 * self.matmul_params * prompt_len + attention + 2 * self.head_params
        return batch * per_prompt
