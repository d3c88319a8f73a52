"""The decode chain (all of a decode step's layers in one C call) computes exactly what the
layer-by-layer path computes: the same hidden states and the same K/V, bit for bit, at any
batch, with int8 panel products, for every family of the layer kit (Qwen3's q/k norms,
Mistral's and Gemma 2's sliding windows shorter than the context, Gemma 2's sandwich norms,
GeGLU, soft-capping and query scale, Qwen2's q/k/v biases, Phi-3's fused products and a
partial rotation, OPT's LayerNorm, biases, ReLU MLP and learned positions), and stopping at
the same safepoints; it never takes a step it cannot run (prefill chunks, hidden-cache rows),
and engines whose kernels it does not call keep the layer-by-layer path."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from quanta import LLM
from quanta.build.checkpoint import make_checkpoint
from quanta.build.engine_build import BuildOptions, build_engine_dir
from quanta.core.request import SamplingParams
from quanta.core.safepoint import StepAborted
from quanta.runner import ModelRunner, decode_chain, panel_linear
from quanta.runner.models.safepoints import Safepoints
from quanta_lab.bench.decode_profile import _Seq  # a PagedSeq: tokens at a position over blocks

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(
        not panel_linear.supports(torch.bfloat16, torch.device("cpu")),
        reason="the chain calls the bf16 panel kernel, which needs AVX512_BF16",
    ),
]
BLOCKS = 24


@pytest.fixture(autouse=True)
def native_attention(monkeypatch) -> None:
    """The suite runs eager attention by default; the chain calls the native kernel."""
    monkeypatch.setenv("QUANTA_ATTENTION_KERNEL", "native")


# Sliding windows shorter than the test's contexts (up to 50 tokens), so they cut.
WINDOW = 8
# Each family's tiny preset, and config changes: Phi-4-mini's partial rotation on Phi-3's layer.
FAMILIES = {
    "qwen2-tiny": {},
    "qwen3-tiny": {},
    "mistral-tiny": {"sliding_window": WINDOW},
    "phi3-tiny": {},
    "phi3-tiny-partial": {"partial_rotary_factor": 0.5},
    "gemma2-tiny": {"sliding_window": WINDOW},
    "opt-tiny": {},
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_checkpoint("llama-tiny", tmp_path_factory.mktemp("ck") / "llama-tiny", seed=4)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_checkpoint(request, tmp_path_factory) -> Path:
    """A kit family's tiny checkpoint, its config changed as ``FAMILIES`` says."""
    preset = request.param.removesuffix("-partial")
    path = make_checkpoint(preset, tmp_path_factory.mktemp("ck") / request.param, seed=5)
    config_path = path / "config.json"
    config_path.write_text(
        json.dumps(json.loads(config_path.read_text()) | FAMILIES[request.param])
    )
    return path


@pytest.fixture(scope="module", params=["int8", "int4"])
def quantized_engine(request, checkpoint, tmp_path_factory) -> tuple[str, Path]:
    engine = tmp_path_factory.mktemp(request.param) / "engine"
    options = BuildOptions(
        kv_cache_memory=1 << 20,
        host_cache_memory=0,
        dtype="bfloat16",
        quantization=request.param,
        group_size=32,
    )
    build_engine_dir(checkpoint, engine, options)
    return request.param, engine


def _runner(path: Path, dtype: str = "bfloat16") -> ModelRunner:
    return ModelRunner(path, num_device_blocks=BLOCKS, num_host_blocks=0, dtype=dtype)


def _prefilled(runner: ModelRunner, lens: tuple[int, ...]) -> list[_Seq]:
    """One decode row per context length, its prompt already in the cache (4 blocks each)."""
    rows = []
    for i, n in enumerate(lens):
        table = tuple(range(4 * i, 4 * i + 4))
        prompt = _Seq(tuple((7 * i + j) % 200 + 3 for j in range(n)), 0, table)
        batch = runner._prepare([prompt], BLOCKS)
        with torch.inference_mode():
            runner.model(batch.input_ids, batch.positions, runner.device_kv_cache, batch.meta)
        rows.append(_Seq((11 + i,), n, table))
    return rows


def _both_paths(runner: ModelRunner, seqs: list[_Seq], safepoints=None):
    """(hidden states, K/V cache after the step) through the chain and layer by layer, each
    from the same cache."""
    model = runner.model
    chain = model.decoder.chain
    before = runner.device_kv_cache.clone()
    batch = runner._prepare(seqs, BLOCKS)
    with torch.inference_mode():
        assert chain.takes(model.decoder.embed_tokens(batch.input_ids), batch.meta)
    results = []
    for path in (chain, None):
        model.use_decode_chain(path)
        runner.device_kv_cache.copy_(before)
        with torch.inference_mode():
            hidden = model(
                batch.input_ids, batch.positions, runner.device_kv_cache, batch.meta, safepoints
            )
        results.append((hidden, runner.device_kv_cache.clone()))
    model.use_decode_chain(chain)
    return results


def test_chain_times_its_parts_when_asked_and_computes_the_same(checkpoint):
    """``timings`` set: each part of the step adds its time there (the decode profile's
    breakdown), and the step's values are those of an untimed step."""
    runner = _runner(checkpoint)
    model, chain = runner.model, runner.model.decoder.chain
    seqs = _prefilled(runner, (9, 33))
    before = runner.device_kv_cache.clone()
    batch = runner._prepare(seqs, BLOCKS)
    hidden = {}
    for timed in (False, True):
        chain.timings = torch.zeros(len(decode_chain.PARTS), dtype=torch.float64) if timed else None
        runner.device_kv_cache.copy_(before)
        with torch.inference_mode():
            hidden[timed] = model(
                batch.input_ids, batch.positions, runner.device_kv_cache, batch.meta
            )
    parts = dict(zip(decode_chain.PARTS, chain.timings.tolist(), strict=True))
    chain.timings = None
    assert torch.equal(hidden[True], hidden[False])
    for part in ("norms", "qkv", "attention", "o", "up", "down"):
        assert parts[part] > 0, part


@pytest.mark.parametrize("lens", [(9,), (9, 33, 1, 50)])
def test_chain_equals_the_layer_by_layer_path(checkpoint, lens):
    runner = _runner(checkpoint)
    assert runner.layer_path == "chain"
    (chained, kv_chained), (layered, kv_layered) = _both_paths(runner, _prefilled(runner, lens))
    assert torch.equal(chained, layered)
    assert torch.equal(kv_chained, kv_layered)
    assert not torch.equal(kv_chained, torch.zeros_like(kv_chained))


def test_chain_equals_the_layer_by_layer_path_for_every_family(family_checkpoint):
    runner = _runner(family_checkpoint)
    assert runner.layer_path == "chain"
    config = runner.model_config
    assert set(config.sliding_windows) <= {0, WINDOW}
    if "partial_rotary_factor" in FAMILIES[family_checkpoint.name]:
        assert runner.model.decoder.layers[0].self_attn.rotary_dim == config.head_dim // 2
    (chained, kv_chained), (layered, kv_layered) = _both_paths(
        runner, _prefilled(runner, (9, 33, 1, 50))
    )
    assert torch.equal(chained, layered)
    assert torch.equal(kv_chained, kv_layered)


def test_family_generation_is_the_same_with_and_without_the_chain(family_checkpoint, monkeypatch):
    """Greedy answers through the whole engine, past the sliding window."""
    prompts = ["Hello there", "1 2 3 4 5 6 7 8 9"]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    answers = []
    for enabled in ("1", "0"):
        monkeypatch.setenv(decode_chain.ENABLE_ENV, enabled)
        with LLM(str(family_checkpoint), dtype="bfloat16") as llm:
            path = llm.engine.describe()["layer_path"]
            assert path == ("chain" if enabled == "1" else "layer-by-layer")
            answers.append([out.token_ids for out in llm.generate(prompts, params)])
    assert answers[0] == answers[1]


def test_chain_runs_quantized_panel_products(quantized_engine):
    mode, engine = quantized_engine
    runner = _runner(engine)
    assert runner.quantized_kernel == f"native-{mode}" and runner.layer_path == "chain"
    (chained, kv_chained), (layered, kv_layered) = _both_paths(runner, _prefilled(runner, (5, 20)))
    assert torch.equal(chained, layered) and torch.equal(kv_chained, kv_layered)


def test_chain_checks_the_same_safepoints_and_stops_there(checkpoint):
    runner = _runner(checkpoint)
    num_layers = runner.model_config.num_layers
    seqs = _prefilled(runner, (6, 12))
    calls: list[list[int]] = [[], []]
    for i, path in enumerate((runner.model.decoder.chain, None)):
        runner.model.use_decode_chain(path)
        batch = runner._prepare(seqs, BLOCKS)
        with torch.inference_mode():
            runner.model(
                batch.input_ids,
                batch.positions,
                runner.device_kv_cache,
                batch.meta,
                Safepoints(1, calls[i].append),
            )
    assert calls[0] == calls[1] == list(range(num_layers))

    def stop_after_first(done: int) -> None:
        if done == 1:
            raise StepAborted(0.0)

    runner.model.use_decode_chain(decode_chain.build(runner.model, _ops(runner), "native"))
    batch = runner._prepare(seqs, BLOCKS)
    with torch.inference_mode(), pytest.raises(StepAborted):
        runner.model(
            batch.input_ids,
            batch.positions,
            runner.device_kv_cache,
            batch.meta,
            Safepoints(1, stop_after_first),
        )
    # Equal results with a check between every layer.
    (chained, _), (layered, _) = _both_paths(runner, seqs, Safepoints(1, lambda _: None))
    assert torch.equal(chained, layered)


def _ops(runner: ModelRunner):
    return runner.model.decoder.layers[0].self_attn.ops


def test_chain_leaves_prefills_and_hidden_rows_to_the_layers(checkpoint, tmp_path):
    runner = _runner(checkpoint)
    decode = _prefilled(runner, (8,))
    chain = runner.model.decoder.chain
    row = torch.empty(1, 64, dtype=torch.bfloat16)
    assert chain.takes(row, runner._prepare(decode, BLOCKS).meta)
    mixed = runner._prepare([*decode, _Seq((3, 4, 5), 0, (20,))], BLOCKS)
    assert not chain.takes(torch.empty(4, 64, dtype=torch.bfloat16), mixed.meta)
    # A hidden-cache row (a model with as many KV heads as query heads offers the cache).
    mha = _runner(make_checkpoint("llama-tiny-mha", tmp_path / "mha", seed=1))
    assert mha.layer_path == "chain"
    hidden = mha._prepare([_Seq((3,), 0, (21,), hidden=True)], BLOCKS)
    assert not mha.model.decoder.chain.takes(row, hidden.meta)


def test_engines_the_chain_cannot_run_keep_the_layers(checkpoint, tmp_path, monkeypatch):
    assert _runner(checkpoint, "float32").layer_path == "layer-by-layer"
    torch_linears = ModelRunner(
        checkpoint, num_device_blocks=4, num_host_blocks=0, dtype="bfloat16", linear_kernel="onednn"
    )
    assert torch_linears.layer_path == "layer-by-layer"
    monkeypatch.setenv(decode_chain.ENABLE_ENV, "0")
    assert _runner(checkpoint).layer_path == "layer-by-layer"


def test_generation_is_the_same_with_and_without_the_chain(checkpoint, monkeypatch):
    """Greedy and seeded answers of a batch, through the whole engine."""
    prompts = ["Hello there", "The quick brown fox", "1 2 3 4 5 6 7 8 9"]
    params = [
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.8, seed=3, ignore_eos=True),
    ]
    answers = []
    for enabled in ("1", "0"):
        monkeypatch.setenv(decode_chain.ENABLE_ENV, enabled)
        with LLM(str(checkpoint), dtype="bfloat16") as llm:
            path = llm.engine.describe()["layer_path"]
            assert path == ("chain" if enabled == "1" else "layer-by-layer")
            answers.append([out.token_ids for p in params for out in llm.generate(prompts, p)])
    assert answers[0] == answers[1]
