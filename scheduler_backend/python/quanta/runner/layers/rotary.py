"""Rotary position embeddings: HF's inverse frequencies for each scaling type, and a table of
cos/sin rows per position shared by every layer of one step.

The angles are computed in fp32 as HF computes them and cast once, so a prefill chunk or a
decode token gets exactly the rotation it would get in a full-sequence forward. Types whose
angles depend on the batch's length (``dynamic``) are refused when the config is parsed.

``longrope`` (Phi-3) has two sets of frequencies; HF picks the long one for a forward call
that reaches past ``original_max_position_embeddings``. With a KV cache a prompt of ``L``
tokens is rotated once, as a whole, and each generated token at position ``p`` in a call of
its own, so a token is rotated long iff ``max(L, p + 1) > original_max_position_embeddings``:
a rule of the token and its request's prompt length alone, whatever the chunking, batching,
swapping or recompute, which the runner's metadata makes possible by giving each row its
request's prompt length (``AttentionMetadata.prompt_lens``). NOTE: HF's ``generate`` for
Phi-3 goes further at the step that first crosses the original context: it drops the cache
and runs the whole sequence again, every key now long. The engine keeps the cached keys
(their values in deeper layers depend on the rotation, so no in-place fix-up reproduces that
step), so its tokens are those of HF's forward with a KV cache; they equal ``generate``'s
for every request that does not grow from inside the original context to past it.
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
    scaling = config.rope_scaling
    if scaling is not None and scaling.rope_type == "longrope":
        return _longrope_inv_freq(config, scaling.short_factor)
    inv_freq = 1.0 / (config.rope_theta ** _exponents(config))
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "yarn":
        return _yarn_inv_freq(config.rope_theta, rotary_dim(config), scaling)
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


def by_prompt_length(config: ModelConfig) -> bool:
    """Whether a row's rotation depends on its request's prompt length (longrope), so the
    runner must give it (``AttentionMetadata.prompt_lens``)."""
    return config.rope_scaling is not None and config.rope_scaling.rope_type == "longrope"


def long_inv_freq(config: ModelConfig) -> torch.Tensor | None:
    """longrope's inverse frequencies for requests past the original context; None for
    every other type (one set serves every position)."""
    scaling = config.rope_scaling
    if scaling is None or not by_prompt_length(config):
        return None
    return _longrope_inv_freq(config, scaling.long_factor)


def _exponents(config: ModelConfig) -> torch.Tensor:
    """``2i / rotary_dim`` of each rotated frequency ``i`` (fp32, CPU), as HF computes it."""
    dim = rotary_dim(config)
    return torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim


def _longrope_inv_freq(config: ModelConfig, factors: tuple[float, ...]) -> torch.Tensor:
    """One of longrope's sets: each base frequency divided by its factor (HF's order of
    operations, so the fp32 values are HF's)."""
    ext = torch.tensor(factors, dtype=torch.float32, device="cpu")
    return 1.0 / (ext * config.rope_theta ** _exponents(config))


def attention_factor(config: ModelConfig) -> float:
    """The factor YaRN and longrope multiply cos and sin by (1 for every other type)."""
    scaling = config.rope_scaling
    if scaling is None or scaling.rope_type not in ("yarn", "longrope"):
        return 1.0
    if scaling.attention_factor is not None:
        return scaling.attention_factor
    if scaling.factor <= 1:
        return 1.0
    if scaling.rope_type == "longrope":
        original = scaling.original_max_position_embeddings
        return math.sqrt(1 + math.log(scaling.factor) / math.log(original))
    return 0.1 * math.log(scaling.factor) + 1.0


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
    model and a buffer would stay on meta. With longrope the table holds both sets, the short
    rows first, and each row picks its set by its position and its request's prompt length."""

    def __init__(self, config: ModelConfig) -> None:
        self.inv_freq = rope_inv_freq(config)
        self.long_inv_freq = long_inv_freq(config)
        scaling = config.rope_scaling
        # longrope's switch: a request longer than this uses the long set
        self.original = scaling.original_max_position_embeddings if scaling else 0
        self.scale = attention_factor(config)
        self._length = 0  # positions per set in the table
        self._table: tuple[torch.Tensor, torch.Tensor] | None = None
        self._reserved: torch.dtype | None = None  # ``reserve``'s dtype: no more growing

    def __call__(
        self,
        positions: torch.Tensor,
        dtype: torch.dtype,
        prompt_lens: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[T, rotary_dim]`` of ``positions``; ``prompt_lens`` ``[T]``, each
        row's request's prompt length, picks longrope's set."""
        table = self._table
        if table is None or self._reserved != dtype:
            needed = int(positions.max()) + 1 if positions.numel() else 1
            if table is None or self._length < needed or table[0].dtype != dtype:
                self._length = 1 << (needed - 1).bit_length()
                table = self._table = self._rows(self._length, dtype, positions.device)
        rows = positions
        if self.long_inv_freq is not None:
            if prompt_lens is None:
                raise ValueError("longrope rotations need each row's prompt length")
            long = torch.maximum(prompt_lens, positions + 1) > self.original
            rows = positions + long.long() * self._length
        return table[0].index_select(0, rows), table[1].index_select(0, rows)

    def reserve(self, length: int, dtype: torch.dtype, device: torch.device) -> None:
        """Fill the table for ``length`` positions now and stop checking positions against it
        (a read back to the host, which a CUDA graph being captured cannot make:
        ``quanta.runner.graphs``); the caller admits no position past ``length``."""
        self._length = 1 << (length - 1).bit_length()
        self._table = self._rows(self._length, dtype, device)
        self._reserved = dtype

    def _rows(
        self, length: int, dtype: torch.dtype, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(length, device=device).float()[:, None]
        sets = [self.inv_freq] + ([] if self.long_inv_freq is None else [self.long_inv_freq])
        freqs = torch.cat([positions * inv_freq.to(device)[None, :] for inv_freq in sets])
        angles = torch.cat((freqs, freqs), dim=-1)
        cos, sin = angles.cos(), angles.sin()
        if self.scale != 1.0:
            cos, sin = cos * self.scale, sin * self.scale
        return cos.to(dtype), sin.to(dtype)
