"""Mistral (sliding-window attention in every layer)
on the layer kit (``quanta.runner.layers``); the options come from its config
(``quanta.families.mistral``), the names are HF's ``MistralForCausalLM``'s."""

from __future__ import annotations

from quanta.runner.layers.decoder import DecoderForCausalLM


class MistralForCausalLM(DecoderForCausalLM):
    """The kit's decoder; ``quanta.families.mistral`` turns its options on."""
