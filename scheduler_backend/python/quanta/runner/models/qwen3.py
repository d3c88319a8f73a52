"""Qwen3 (per-head q/k RMSNorm)
on the layer kit (``quanta.runner.layers``); the options come from its config
(``quanta.families.qwen3``), the names are HF's ``Qwen3ForCausalLM``'s."""

from __future__ import annotations

from quanta.runner.layers.decoder import DecoderForCausalLM


class Qwen3ForCausalLM(DecoderForCausalLM):
    """The kit's decoder; ``quanta.families.qwen3`` turns its options on."""
