"""Rotary position embeddings: HF's inverse frequencies for each scaling type, and a table of
cos/sin rows per position shared by every layer of one step.

The angles are computed in fp32 as HF computes them and cast once, so a prefill chunk or a
decode token gets exactly the rotation it would get in a full-sequence forward. Types whose
angles depend on the batch's length (``dynamic``) or on two tables picked by length
(``longrope``) are refused when the config is parsed, not here.
"""

from __future__ import annotations

import math

import torch

from quanta.families.config import ModelConfig, RopeScaling


def rotary_dim(config: ModelConfig) -> int:
    """How many of each head's features rotate (all but a partial rotation's rest)."""
    return int(config.head_dim * config.partial_rotary_factor)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies (fp32, CPU) with the config's scaling, as HF computes them."""
    dim = rotary_dim(config)
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    inv_freq = 1.0 / (config.rope_theta**exponents)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "yarn":
        return _yarn_inv_freq(config.rope_theta, dim, scaling)
    # llama3: keep high frequencies, divide low ones by factor, blend in between.
    old_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_len / scaling.low_freq_factor
    high_freq_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def attention_factor(config: ModelConfig) -> float:
    """The factor YaRN multiplies cos and sin by (1 for every other type)."""
    scaling = config.rope_scaling
    if scaling is None or scaling.rope_type != "yarn":
        return 1.0
    if scaling.attention_factor is not None:
        return scaling.attention_factor
    return 0.1 * math.log(scaling.factor) + 1.0 if scaling.factor > 1 else 1.0


def _yarn_inv_freq(base: float, dim: int, scaling: RopeScaling) -> torch.Tensor:
    """YaRN: interpolate the low frequencies, keep the high ones, ramp between."""

    def correction_dim(rotations: float) -> float:
        old_len = scaling.original_max_position_embeddings
        return (dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(
        0, 1
    )
    pos_freqs = base ** (torch.arange(0, dim, 2, device="cpu").to(dtype=torch.float) / dim)
    extrapolation = 1 - ramp
    return (1.0 / (scaling.factor * pos_freqs)) * (1 - extrapolation) + (
        1.0 / pos_freqs
    ) * extrapolation


class RotaryTable:
    """cos and sin rows of every position so far, grown to the next power of two when a step
    reaches past it; a plain object, not a module, since weights are loaded onto a meta-built
    model and a buffer would stay on meta."""

    def __init__(self, config: ModelConfig) -> None:
        self.inv_freq = rope_inv_freq(config)
        self.scale = attention_factor(config)
        self._table: tuple[torch.Tensor, torch.Tensor] | None = None

    def __call__(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[T, rotary_dim]`` of ``positions``."""
        table = self._table
        needed = int(positions.max()) + 1 if positions.numel() else 1
        if table is None or table[0].shape[0] < needed or table[0].dtype != dtype:
            table = self._table = self._rows(
                1 << (needed - 1).bit_length(), dtype, positions.device
            )
        return table[0].index_select(0, positions), table[1].index_select(0, positions)

    def _rows(
        self, length: int, dtype: torch.dtype, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(length, device=device)
        freqs = positions.float()[:, None] * self.inv_freq.to(device)[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        cos, sin = angles.cos(), angles.sin()
        if self.scale != 1.0:
            cos, sin = cos * self.scale, sin * self.scale
        return cos.to(dtype), sin.to(dtype)
