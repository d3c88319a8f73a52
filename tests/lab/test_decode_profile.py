"""``quanta bench decode-profile``: a step of several rows, and the decode chain's own parts
where the chain runs the step."""

from __future__ import annotations

import pytest
import torch
from quanta.build.checkpoint import make_checkpoint
from quanta.runner import panel_linear
from quanta.runner.decode_chain import PARTS
from quanta_lab.bench.decode_profile import profile_decode

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint("llama-tiny", tmp_path_factory.mktemp("ck") / "llama-tiny", seed=1)


def test_a_layer_by_layer_step_of_several_rows(checkpoint):
    p = profile_decode(checkpoint, "float32", context=20, repeat=1, rows=3)
    assert p.rows == 3 and p.layer_path == "layer-by-layer"
    assert p.step_ms > 0 and p.products_ms > 0 and p.parts_us["qkv"] > 0
    assert p.chain_parts_us == {}


@pytest.mark.skipif(
    not panel_linear.supports(torch.bfloat16, torch.device("cpu")),
    reason="the chain calls the bf16 panel kernel, which needs AVX512_BF16",
)
def test_a_chain_step_reports_the_chains_parts(checkpoint, monkeypatch):
    monkeypatch.setenv("QUANTA_ATTENTION_KERNEL", "native")
    p = profile_decode(checkpoint, "bfloat16", context=20, repeat=1, rows=2)
    assert p.layer_path == "chain"
    assert set(p.chain_parts_us) == set(PARTS)
    assert p.chain_parts_us["attention"] > 0 and p.chain_parts_us["qkv"] > 0
