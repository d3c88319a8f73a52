"""Random weights made on the device (``load_format="dummy"``): the engine a real shape is
benchmarked with when no checkpoint is on disk."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from quanta.build.checkpoint import write_model_files
from quanta.core.config import CacheConfig, EngineConfig
from quanta.core.request import SamplingParams
from quanta.frontends.engine import build_engine
from quanta.runner.models import build_model_skeleton, load_model_config
from quanta.runner.random_weights import fill_random_weights

TINY = ["llama-tiny", "opt-tiny", "qwen2-tiny", "qwen3-tiny", "gemma2-tiny", "phi3-tiny"]


@pytest.fixture(scope="module")
def shapes(tmp_path_factory) -> dict[str, Path]:
    """Each tiny preset's config.json and tokenizer, no weights."""
    base = tmp_path_factory.mktemp("shapes")
    made = {}
    for name in TINY:
        (base / name).mkdir()
        made[name] = write_model_files(name, base / name)
    return made


def _filled(directory: Path, seed: int = 0) -> torch.nn.Module:
    model = build_model_skeleton(load_model_config(directory))
    fill_random_weights(model, dtype=torch.float32, device=torch.device("cpu"), seed=seed)
    return model


def test_a_weightless_directory_holds_config_and_tokenizer_only(shapes):
    names = {p.name for p in shapes["llama-tiny"].iterdir()}
    assert "config.json" in names and "tokenizer.json" in names
    assert not any(n.endswith(".safetensors") for n in names)


@pytest.mark.parametrize("name", TINY)
def test_every_parameter_is_made_on_the_device_as_a_fresh_model_is(shapes, name):
    model = _filled(shapes[name])
    for pname, param in model.named_parameters():
        assert param.device.type == "cpu" and not param.requires_grad, pname
        assert torch.isfinite(param).all(), pname
        if pname.endswith("bias"):
            assert not param.any(), pname
        elif param.dim() > 1:
            assert 0.015 < param.std().item() < 0.025, pname  # HF's normal(0, 0.02)


def test_a_seed_gives_the_same_weights_and_another_seed_others(shapes):
    one, same, other = (_filled(shapes["llama-tiny"], s) for s in (0, 0, 1))
    for (name, a), b, c in zip(
        one.named_parameters(), same.parameters(), other.parameters(), strict=True
    ):
        assert torch.equal(a, b), name
        if a.dim() > 1:
            assert not torch.equal(a, c), name


def test_a_tied_head_is_the_embedding(shapes):
    model = _filled(shapes["opt-tiny"])  # OPT ties its LM head
    assert model.lm_head.weight is model.decoder.embed_tokens.weight


@pytest.mark.engine
@pytest.mark.parametrize("name", ["llama-tiny", "opt-tiny", "gemma2-tiny"])
def test_an_engine_with_random_weights_generates(shapes, name):
    cache = CacheConfig(num_device_blocks=16, num_host_blocks=0)
    engine = build_engine(
        EngineConfig(model=str(shapes[name]), load_format="dummy", cache=cache, dtype="float32")
    )
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=1)
    stream = engine.loop.submit(engine.make_request([5, 6, 7, 8, 9], params))
    engine.loop.run_until_idle()
    result = stream.result(timeout=0)
    assert result.error is None and len(result.token_ids) == 4
    engine.runner.close()
