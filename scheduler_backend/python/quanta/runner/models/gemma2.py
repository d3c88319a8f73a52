"""Gemma 2 (GeGLU, sandwich norms, soft-capping, alternating windows)
on the layer kit (``quanta.runner.layers``); the options come from its config
(``quanta.families.gemma2``), the names are HF's ``Gemma2ForCausalLM``'s."""

from __future__ import annotations

from quanta.runner.layers.decoder import DecoderForCausalLM


class Gemma2ForCausalLM(DecoderForCausalLM):
    """The kit's decoder; ``quanta.families.gemma2`` turns its options on."""
