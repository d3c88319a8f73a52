"""Phi-3 (fused qkv_proj and gate_up_proj, partial rotation)
on the layer kit (``quanta.runner.layers``); the options come from its config
(``quanta.families.phi3``), the names are HF's ``Phi3ForCausalLM``'s."""

from __future__ import annotations

from quanta.runner.layers.decoder import DecoderForCausalLM


class Phi3ForCausalLM(DecoderForCausalLM):
    """q/k/v and gate/up are stored fused: the kit loads them as one linear each."""

    fused = True
