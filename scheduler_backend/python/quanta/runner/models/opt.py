"""OPT (LayerNorm, learned positions, biases, a plain ReLU MLP; post-norm as opt-350m, an
embedding narrower than the layers as opt-350m) on the layer kit (``quanta.runner.layers``);
the options come from its config (``quanta.families.opt``), the names are HF's
``OPTForCausalLM``'s (``model.decoder.layers.N.fc1`` ...)."""

from __future__ import annotations

import dataclasses

from quanta.runner.layers.decoder import DecoderForCausalLM, Layout
from quanta.runner.models.config import ModelConfig


class OPTForCausalLM(DecoderForCausalLM):
    """The kit's decoder with OPT's parts, each under the name its checkpoint gives it."""

    layout = Layout(
        layer_norm=True,
        learned_positions=True,
        plain_mlp=("fc1", "fc2"),
        decoder="model.decoder",
        norms=("self_attn_layer_norm", "final_layer_norm"),
        final_norm="final_layer_norm",
        out_proj="out_proj",
    )

    def __init__(self, config: ModelConfig) -> None:
        # OPT's one ``enable_bias`` is the kit's attention and MLP biases.
        bias = config.enable_bias
        super().__init__(dataclasses.replace(config, attention_bias=bias, mlp_bias=bias))
