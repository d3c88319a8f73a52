"""Qwen2 and Qwen2.5 (q/k/v biases)
on the layer kit (``quanta.runner.layers``); the options come from its config
(``quanta.families.qwen2``), the names are HF's ``Qwen2ForCausalLM``'s."""

from __future__ import annotations

from quanta.runner.layers.decoder import DecoderForCausalLM


class Qwen2ForCausalLM(DecoderForCausalLM):
    """The kit's decoder; ``quanta.families.qwen2`` turns its options on."""
