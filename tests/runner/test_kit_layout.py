"""What OPT's layers on the layer kit expose once fused: the kit's names (``self_attn.qkv_proj``,
``o_proj``, ``mlp.up_proj``/``down_proj``, ``norms``) whatever the checkpoint calls them, so
the engine's shared machinery reads every family alike; and why the decode chain skips them."""

from __future__ import annotations

import pytest
import torch
from quanta.runner.layers.decoder import DecoderForCausalLM
from quanta.runner.layers.mlp import MLP
from quanta.runner.layers.norms import LayerNorm
from quanta.runner.linear import fuse_model
from quanta.runner.models.config import parse_model_config
from quanta.runner.models.opt import OPTForCausalLM

OPT = {
    "model_type": "opt",
    "vocab_size": 64,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "ffn_dim": 48,
    "max_position_embeddings": 16,
}


def _opt(**overrides: object) -> DecoderForCausalLM:
    model = OPTForCausalLM(parse_model_config({**OPT, **overrides}))
    fuse_model(model, "torch")
    return model


def test_an_opt_layer_has_the_kit_names_once_fused():
    model = _opt()
    names = {name for name, _ in model.named_parameters()}
    assert "model.decoder.layers.0.self_attn.o_proj.weight" in names
    layer = model.decoder.layers[0]
    assert not hasattr(layer.self_attn, "out_proj") and not hasattr(layer, "fc1")
    assert layer.self_attn.qkv_proj.out_features == 3 * 32
    assert layer.self_attn.o_proj.bias is not None
    assert isinstance(layer.mlp, MLP) and layer.mlp.fused_activation  # ReLU on the product
    assert (layer.mlp.up_proj.out_features, layer.mlp.down_proj.in_features) == (48, 48)
    first, second = layer.norms
    assert first is layer.self_attn_layer_norm and second is layer.final_layer_norm
    assert isinstance(first, LayerNorm) and first.bias is not None
    assert model.embedding == "model.decoder.embed_tokens"
    assert model.decoder.final_norm is model.decoder.final_layer_norm


def test_the_decode_chain_is_told_why_an_opt_layer_is_not_its_layer():
    """The chain computes pre-norm OPT (LayerNorm, ReLU MLP, no rotation), not post-norm."""
    assert _opt().decoder.layers[0].decode_chain_blocker() is None
    blocker = _opt(do_layer_norm_before=False).decoder.layers[0].decode_chain_blocker()
    assert blocker is not None and "post-norm" in blocker


def test_an_opt_layer_splits_its_own_mlp_linears_until_fused():
    model = OPTForCausalLM(parse_model_config(OPT))
    layer = model.decoder.layers[0]
    plan = layer.tensor_parallel()
    assert (plan["fc1"].kind, plan["fc2"].kind) == ("columns", "rows")
    assert layer.self_attn.tensor_parallel()["out_proj"].kind == "rows"
    fuse_model(model, "torch")
    assert layer.tensor_parallel() == {} and layer.mlp.tensor_parallel()["down_proj"].kind == "rows"
    assert layer.self_attn.tensor_parallel()["o_proj"].kind == "rows"


def test_an_activation_the_plain_mlp_does_not_compute_is_refused():
    with pytest.raises(NotImplementedError, match="activation 'tanh'"):
        OPTForCausalLM(parse_model_config({**OPT, "activation_function": "tanh"}))


def test_post_norm_opt_has_no_final_norm_and_ignores_a_stored_one():
    model = _opt(do_layer_norm_before=False, word_embed_proj_dim=16)
    assert model.decoder.final_norm is None
    assert model.is_ignorable_weight("model.decoder.final_layer_norm.weight")
    assert model.decoder.project_out is not None and model.lm_head.in_features == 16
    with torch.no_grad():
        assert model.compute_logits(torch.zeros(1, 16)).shape == (1, 64)
