"""Weight-only quantization: the stored layout, torch's kernels against a dequantized
reference, GGUF blocks kept exactly, and engines that answer as their dequantized twins.

The reference is always the same quantized values dequantized to fp32 (never the float
weights before quantization): what is checked is that the kernels and repacking compute
what the codes mean, not how much quantization loses (``quanta bench quality`` measures that).
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from quanta.build.checkpoint import make_checkpoint
from quanta.build.engine_build import BuildOptions, build_engine_dir
from quanta.build.gguf_export import write_gguf
from quanta.build.gguf_import import gguf_to_checkpoint
from quanta.build.gguf_kept import kept_weight
from quanta.build.manifest import EngineManifestError, apply_manifest, read_manifest
from quanta.build.quantization import write_dequantized
from quanta.build.steps import BuildError
from quanta.core.config import EngineConfig
from quanta.core.request import SamplingParams
from quanta.runner import panel_linear, quantized
from quanta.runner.quantized import QuantizedLinear, QuantizedWeight, concat, quantize
from safetensors.torch import load_file

Q = gguf.GGMLQuantizationType
PROMPTS = ["Hello, world!", "The quick brown fox 12345"]


def _weight(rows: int = 64, cols: int = 128, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(
    ("mode", "group", "symmetric", "bound"),
    [("int8", 0, True, 1 / 254), ("int4", 32, False, 1 / 30), ("int4", 64, True, 1 / 16)],
)
def test_quantize_rounds_each_weight_to_its_nearest_code(mode, group, symmetric, bound):
    w = _weight()
    q = quantize(w, mode, group, symmetric)
    assert (q.out_features, q.in_features) == tuple(w.shape)
    assert (q.zeros is None) == (symmetric or mode == "int8")
    error = (q.dequantize() - w).abs()
    # within half a step of the range each scale covers
    span = w.abs().amax() * 2 if symmetric else (w.amax() - w.amin())
    assert float(error.max()) <= float(span) * bound + 1e-6


def test_int4_codes_round_trip_through_the_nibble_layout():
    codes = torch.randint(0, 16, (32, 64), dtype=torch.int32)
    u = codes.to(torch.uint8)
    packed = u[:, 0::2] | (u[:, 1::2] << 4)
    weight = QuantizedWeight("int4", packed, torch.ones(32, 2), None)
    assert torch.equal(weight.codes(), codes)


@pytest.mark.parametrize(
    ("mode", "group", "symmetric"), [("int8", 0, True), ("int4", 32, False), ("int4", 128, True)]
)
@pytest.mark.parametrize("rows", [1, 5, 40])
@pytest.mark.parametrize("panel", [True, False])
def test_quantized_kernels_compute_the_dequantized_product(
    mode, group, symmetric, rows, panel, monkeypatch
):
    """The panel kernels (native-int8, native-int4) and torch's (int8pack / int4pack, as on
    CPUs without AVX512_BF16) in bf16, both sides of DEQUANT_ROWS and of the panel kernels'
    widening, against fp32 on the dequantized weight: torch's int4pack convention is
    (q - 8) * scale + zero."""
    if panel and not panel_linear.supports(torch.bfloat16, torch.device("cpu")):
        pytest.skip("no AVX512_BF16 here")
    if not panel:
        monkeypatch.setattr(quantized.panel_linear, "supports", lambda *_: False)
    w = quantize(_weight(96, 256), mode, group, symmetric)
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(1))
    bias = torch.randn(96)
    layer = QuantizedLinear(w, bias, "none", torch.bfloat16)
    kernels = {"int8": ("native-int8", "int8pack"), "int4": ("native-int4", "int4pack")}
    assert layer.kernel == kernels[mode][0 if panel else 1]
    ref = x.bfloat16().float() @ w.dequantize().T + bias
    got = layer(x.bfloat16()).float()
    assert torch.allclose(got, ref, rtol=2e-2, atol=0.15 * ref.abs().mean().item())


@pytest.mark.skipif(
    not panel_linear.supports(torch.bfloat16, torch.device("cpu")), reason="no AVX512_BF16"
)
@pytest.mark.parametrize(("n", "k", "group"), [(96, 256, 32), (130, 64, 64), (576, 1536, 128)])
def test_int4_panel_kernel_rounds_the_exact_product_once_at_any_batch(n, k, group):
    """The int4 panel kernel against the exact product of x and code * scale + min (fp16
    scales and mins, as it keeps them): within the one bf16 rounding of the result, and a row
    gets the same bits alone as among up to 7 rows (the direct and the widened paths). From
    16 rows, where the CPU has AMX, the panel is dequantized to bf16 for the tiles:
    then within one rounding of the product with the bf16-rounded weights."""
    lib = panel_linear.load()
    gen = torch.Generator().manual_seed(n)
    w = quantize(torch.randn(n, k, generator=gen), "int4", group, symmetric=False)
    scales, mins = w.scales.half().float(), quantized._mins(w).half().float()
    packed, sm = lib.pack_int4(w.codes()), lib.int4_scales(w.scales, quantized._mins(w))
    bias = torch.randn(n, generator=gen).bfloat16()
    x = torch.randn(40, k, generator=gen).bfloat16()
    exact = w.codes().double().view(n, k // group, group) * scales[..., None].double()
    exact = (exact + mins[..., None].double()).view(n, k)

    def within_one_rounding(got: torch.Tensor, weight: torch.Tensor, rows: int) -> bool:
        want = x[:rows].double() @ weight.T + bias.double()
        bound = want.abs() * 2**-8 + 1e-5 * want.abs().max()
        return bool(((got.double() - want).abs() <= bound).all())

    few = lib.product_int4(x[:7], packed, sm, bias, n, group)
    assert within_one_rounding(few, exact, 7)
    for rows in (1, 3, 4, 5):
        assert torch.equal(lib.product_int4(x[:rows], packed, sm, bias, n, group), few[:rows])
    many = lib.product_int4(x, packed, sm, bias, n, group)
    tiles = lib.amx_rows is not None and k % 32 == 0  # 40 rows: past the int4 tile rows
    assert within_one_rounding(many, exact.float().bfloat16().double() if tiles else exact, 40)
    if not tiles:
        assert torch.equal(many[:7], few)


@pytest.mark.parametrize("panel", [True, False])
def test_int8pack_runs_on_a_weight_whose_data_is_not_aligned(panel, monkeypatch):
    """A weight read from safetensors may start at any byte; torch's kernel needs alignment
    (run with the panel kernel, which packs a copy, and without it, as on CPUs lacking it)."""
    if panel and not panel_linear.supports(torch.bfloat16, torch.device("cpu")):
        pytest.skip("no AVX512_BF16 here")
    if not panel:
        monkeypatch.setattr(quantized.panel_linear, "supports", lambda *_: False)
    w = quantize(_weight(576, 576), "int8", 0, True)
    buffer = torch.zeros(w.qweight.numel() + 1, dtype=torch.int8)
    unaligned = buffer[1:].view(576, 576).copy_(w.qweight)
    layer = QuantizedLinear(
        QuantizedWeight("int8", unaligned, w.scales, None), None, "none", torch.bfloat16
    )
    assert layer.kernel == ("native-int8" if panel else "int8pack")
    x = torch.randn(6, 576).bfloat16()
    assert torch.allclose(layer(x).float(), x.float() @ w.dequantize().T, rtol=2e-2, atol=0.5)


@pytest.mark.skipif(
    not panel_linear.supports(torch.bfloat16, torch.device("cpu")), reason="no AVX512_BF16"
)
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 9, 33])
@pytest.mark.parametrize(("n", "k"), [(130, 37), (64, 576)])
def test_native_int8_rounds_the_exact_product_once(rows, n, k):
    """The panel kernel on int8 codes, both of its paths (codes read directly up to 4 rows,
    the panel widened once above): the exact sum of x * code, times the column's scale, plus
    the bias, rounded once to bf16 (one bf16 step for the order of the fp32 sums)."""
    gen = torch.Generator().manual_seed(rows + n + k)
    w = quantize(torch.randn(n, k, generator=gen), "int8", 0, True)
    bias = torch.randn(n, generator=gen)
    layer = QuantizedLinear(w, bias, "none", torch.bfloat16)
    assert layer.kernel == "native-int8"
    x = torch.randn(rows, k, generator=gen).bfloat16()
    exact = x.double() @ w.qweight.double().T * w.scales.double().view(1, -1)
    exact = exact + bias.bfloat16().double()
    got = layer(x).double()
    assert ((got - exact).abs() <= exact.abs().clamp_min(1e-2) * 2.0**-7 + 1e-6 * k).all()


def _x16(x: torch.Tensor, block: int = 128) -> torch.Tensor:
    """x as the int8 kernel's VNNI path reads it (panel_linear.c, quantize_rows): per block
    of ``block`` columns, rounded to 2^-15 of the power of two above the block's largest."""
    out = x.double().clone()
    for c in range(0, x.shape[1], block):
        part = out[:, c : c + block]
        largest = part.abs().amax(dim=1, keepdim=True)
        e = torch.frexp(largest.float().clamp_min(1e-30))[1].double()
        step = torch.where(largest > 0, 2.0 ** (e - 15), torch.ones_like(largest))
        out[:, c : c + block] = torch.round(part / step) * step
    return out


@pytest.mark.skipif(
    panel_linear.load() is None or panel_linear.load().int8_rows != "vnni",
    reason="no AVX512_BF16 with AVX512_VNNI",
)
def test_native_int8_at_a_few_rows_sums_x_in_16_bits():
    """Up to 4 rows the int8 product reads x in 16-bit fixed point per 128 columns: exact for
    elements within 2^7 of their block's largest, the rest rounded to 2^-15 of it. The
    product is the exact sum of that form times the codes, rounded once; a row's bits do not
    depend on the rows beside it; a non-finite x propagates as in bf16."""
    gen = torch.Generator().manual_seed(7)
    n, k = 200, 300  # a partial last block, a panel cut short
    w = quantize(torch.randn(n, k, generator=gen), "int8", 0, True)
    bias = torch.randn(n, generator=gen).bfloat16()
    lib = panel_linear.load()
    packed, scales = lib.pack_int8(w.qweight), w.scales.view(-1).float().contiguous()
    x = torch.randn(4, k, generator=gen)
    x[1, 5], x[1, 200] = 3e4, 1e-7  # one row whose small elements are rounded
    x[2] = 0.0
    x = x.bfloat16()

    def product(rows: torch.Tensor) -> torch.Tensor:
        return lib.product_int8(rows, packed, scales, bias, n)

    got = product(x).double()
    codes = w.qweight.double().T * w.scales.double().view(1, -1)
    want = _x16(x) @ codes + bias.double()
    assert ((got - want).abs() <= want.abs() * 2**-8 + 1e-6).all()
    assert torch.equal(got[2], bias.double())
    # row 1's small elements are off by more than the rounding: the 16-bit form is what ran
    assert not torch.equal(_x16(x)[1], x[1].double())
    for r in range(4):
        assert torch.equal(product(x[r : r + 1]), product(x)[r : r + 1])
    bad = x.clone()
    bad[0, 3], bad[3, 9] = float("nan"), float("inf")
    out = product(bad)
    assert not out[0].isfinite().any() and not out[3].isfinite().any()
    exact = x.double() @ codes + bias.double()
    assert ((out[1:3].double() - exact[1:3]).abs() <= exact[1:3].abs() * 2**-7 + 1e-3).all()


@pytest.mark.parametrize(
    ("mode", "kernel"),
    [("int8", "native-int8"), ("int4", "native-int4"), ("int8", "int8pack"), ("int4", "dequant")],
)
def test_a_products_rows_are_its_weight_dequantized(mode, kernel, monkeypatch):
    """What a quantized embedding sharing a tied head looks up: rows read back from each
    kernel's own layout (panels cut short at 130 rows, an odd width for int8) are the
    dequantized weight's, rounded once to the serving dtype."""
    native = kernel.startswith("native")
    if native and not panel_linear.supports(torch.bfloat16, torch.device("cpu")):
        pytest.skip("no AVX512_BF16 here")
    if not native:
        monkeypatch.setattr(quantized.panel_linear, "supports", lambda *_: False)
    k = 37 if mode == "int8" else 96
    w = quantize(_weight(130, k, seed=4), mode, 32, symmetric=False)
    if mode == "int4":  # scales and mins that fp16 holds, as a GGUF's are
        scales = w.scales.half().float()
        w = QuantizedWeight(
            "int4", w.qweight, scales, quantized._mins(w).half().float() + 8 * scales
        )
    dtype = torch.float32 if kernel == "dequant" else torch.bfloat16
    layer = QuantizedLinear(w, None, "none", dtype)
    assert layer.kernel == kernel
    ids = torch.tensor([0, 129, 63, 64, 5, 5, 100])
    rows = layer.rows(ids)
    assert rows is not None and rows.dtype == dtype
    scales = w.scales.to(dtype).float() if kernel == "int8pack" else w.scales
    if mode == "int8":
        want = w.qweight.float() * scales
    else:
        want = (w.codes().float().view(130, -1, 32) * scales[..., None]).view(130, k)
        want = want + quantized._mins(w).repeat_interleave(32, dim=1)
    assert torch.allclose(rows.float(), want[ids].to(dtype).float(), rtol=0, atol=1e-6)


def test_fp32_and_grouped_int8_dequantize_per_call():
    w = quantize(_weight(), "int4", 32, False)
    layer = QuantizedLinear(w, None, "relu", torch.float32)
    assert layer.kernel == "dequant"
    x = torch.randn(3, 128)
    assert torch.allclose(layer(x), torch.relu(x @ w.dequantize().T), atol=1e-5)
    grouped = QuantizedWeight("int8", w.codes().to(torch.int8) - 8, w.scales, None)
    assert QuantizedLinear(grouped, None, "none", torch.bfloat16).kernel == "dequant"


def test_fused_products_concatenate_rows_with_their_scales():
    parts = [quantize(_weight(32 * (i + 1), seed=i), "int4", 32, False) for i in range(3)]
    fused = concat(parts)
    assert torch.equal(fused.dequantize(), torch.cat([p.dequantize() for p in parts]))


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1])
def test_gguf_blocks_are_kept_exactly(qtype):
    """Repacked codes and scales dequantize to what llama.cpp's own dequantizer gives."""
    w = _weight(64, 96, seed=3).numpy()
    raw = gguf.quants.quantize(w, qtype)
    want = gguf.quants.dequantize(raw, qtype).reshape(w.shape)
    kept = kept_weight(raw, qtype.name, w.shape)
    assert kept.group_size == 32
    assert np.allclose(kept.dequantize().numpy(), want, atol=1e-6)


# -- engines --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_checkpoint("llama-tiny", tmp_path_factory.mktemp("ck") / "llama-tiny", seed=5)


def _options(**kw) -> BuildOptions:
    return BuildOptions(kv_cache_memory=1 << 20, host_cache_memory=0, **kw)


def test_build_records_the_quantization_and_stores_codes(checkpoint, tmp_path):
    m = build_engine_dir(
        checkpoint, tmp_path / "e", _options(dtype="float32", quantization="int4", group_size=32)
    )
    q = m.quantization
    assert q is not None and (q.mode, q.group_size, q.symmetric) == ("int4", 32, False)
    # llama-tiny's down projection is 176 wide: no whole groups of 32, so it stays float
    assert all(n.endswith("down_proj.weight") for n in q.not_quantized)
    stored = load_file(str(tmp_path / "e" / "model.safetensors"))
    assert stored["model.layers.0.self_attn.q_proj.qweight"].dtype == torch.uint8
    # scales and mins as the int4 kernel reads them: fp16, no wider
    assert stored["model.layers.0.self_attn.q_proj.scales"].dtype == torch.float16
    assert stored["model.layers.0.self_attn.q_proj.mins"].dtype == torch.float16
    assert "model.layers.0.self_attn.q_proj.weight" not in stored
    assert "model.embed_tokens.weight" in stored  # the embedding is not quantized
    assert read_manifest(tmp_path / "e") == m


def test_the_load_check_refuses_another_quantization(checkpoint, tmp_path):
    m = build_engine_dir(checkpoint, tmp_path / "e", _options(quantization="int8"))
    apply_manifest(EngineConfig(model="e", quantization="int8"), m)
    with pytest.raises(EngineManifestError, match="built with quantization int8"):
        apply_manifest(EngineConfig(model="e", quantization="int4"), m)
    plain = build_engine_dir(checkpoint, tmp_path / "f", _options())
    with pytest.raises(EngineManifestError, match="quantization none"):
        apply_manifest(EngineConfig(model="f", quantization="int8"), plain)


def test_keep_needs_a_quantized_gguf(checkpoint, tmp_path):
    with pytest.raises(BuildError, match="keep needs a GGUF"):
        build_engine_dir(checkpoint, tmp_path / "e", _options(quantization="keep"))


def test_gguf_keep_writes_kept_tensors_with_q_and_k_rows_unpermuted(checkpoint, tmp_path):
    path = tmp_path / "m.gguf"
    write_gguf(checkpoint, path, qtype=Q.Q4_1)
    floats, kept = tmp_path / "floats", tmp_path / "kept"
    floats.mkdir()
    kept.mkdir()
    gguf_to_checkpoint(path, floats)
    summary = gguf_to_checkpoint(path, kept, keep=frozenset({"Q4_1"}))
    assert summary.kept is not None and summary.kept.kept["Q4_1"] > 0
    want = load_file(str(floats / "model.safetensors"))
    got = load_file(str(kept / "model.safetensors"))
    for name in ("self_attn.q_proj", "self_attn.k_proj", "mlp.gate_proj"):
        base = f"model.layers.1.{name}"
        weight = QuantizedWeight.from_tensors(
            {p: got[f"{base}.{p}"] for p in ("qweight", "scales", "mins")}
        )
        assert torch.allclose(weight.dequantize(), want[f"{base}.weight"], atol=1e-6), name


def _answers(engine: Path, dtype: str) -> list[list[int]]:
    from quanta.frontends.offline import LLM

    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    return [list(r.token_ids) for r in LLM(str(engine), dtype=dtype).generate(PROMPTS, params)]


def _logprobs(engine: Path, dtype: str) -> torch.Tensor:
    from quanta.frontends.offline import LLM
    from quanta_lab.bench.quality import quanta_token_logprobs

    ids = [(7 * i + 3) % 200 + 1 for i in range(40)]
    return torch.tensor(quanta_token_logprobs(LLM(str(engine), dtype=dtype), ids))


@pytest.mark.engine
@pytest.mark.parametrize(
    ("source", "quantization"),
    [("hf", "int8"), ("hf", "int4"), ("gguf-Q4_1", "keep"), ("opt", "int8"), ("opt", "int4")],
)
def test_quantized_engine_answers_as_its_dequantized_reference(
    checkpoint, tmp_path, source, quantization
):
    """fp32 (the dequantizing kernel): greedy answers equal those of a float engine holding
    the same quantized values dequantized (OPT: biases and the ReLU fused on the product)."""
    src: Path = checkpoint
    if source == "opt":
        src = make_checkpoint("opt-tiny", tmp_path / "opt", seed=3)
    if source.startswith("gguf"):
        src = tmp_path / "m.gguf"
        write_gguf(checkpoint, src, qtype=Q[source.removeprefix("gguf-")])
    engine = tmp_path / "quantized"
    options = _options(dtype="float32", quantization=quantization, group_size=32)
    build_engine_dir(src, engine, options)
    reference = write_dequantized(engine, tmp_path / "reference")
    assert json.loads((reference / "config.json").read_text())["torch_dtype"] == "float32"
    assert _answers(engine, "float32") == _answers(reference, "float32")


@pytest.mark.engine
@pytest.mark.parametrize(("source", "quantization"), [("hf", "int8"), ("gguf-Q4_1", "keep")])
def test_bf16_kernels_stay_within_bf16_rounding_of_the_reference(
    checkpoint, tmp_path, source, quantization
):
    """bf16 (int8pack, int4pack): a random tiny model's logits are too flat for greedy
    answers to survive any rounding, so the log-probabilities of a fixed text are compared:
    the quantized engine is no further from the fp32 reference than the reference itself
    run in bf16 (float kernels) is."""
    src: Path = checkpoint
    if source.startswith("gguf"):
        src = tmp_path / "m.gguf"
        write_gguf(checkpoint, src, qtype=Q[source.removeprefix("gguf-")])
    engine = tmp_path / "quantized"
    build_engine_dir(src, engine, _options(dtype="bfloat16", quantization=quantization))
    reference = write_dequantized(engine, tmp_path / "reference")
    want = _logprobs(reference, "float32")
    rounding = float((_logprobs(reference, "bfloat16") - want).abs().max())
    error = float((_logprobs(engine, "bfloat16") - want).abs().max())
    assert error <= 2 * rounding + 1e-3, (error, rounding)


@pytest.mark.engine
def test_a_tied_head_is_quantized_from_the_embedding_in_a_group_that_divides(tmp_path):
    """SmolLM2-like widths: 128 does not divide 576, so 64 is taken and recorded; the tied
    head is written under its own name and the engine answers as its dequantized twin."""
    from safetensors.torch import save_file

    ck = make_checkpoint("llama-tiny", tmp_path / "ck", seed=2)
    config = json.loads((ck / "config.json").read_text())
    (ck / "config.json").write_text(json.dumps(config | {"tie_word_embeddings": True}))
    weights = load_file(str(ck / "model.safetensors"))
    del weights["lm_head.weight"]
    save_file(weights, str(ck / "model.safetensors"), metadata={"format": "pt"})
    m = build_engine_dir(
        ck,
        tmp_path / "e",
        _options(dtype="float32", quantization="int4", group_size=128, quantize_lm_head=True),
    )
    q = m.quantization
    assert q is not None and q.lm_head and q.group_size is None  # 64-wide inputs: group 64
    assert set(q.smaller_groups.values()) == {64}
    stored = load_file(str(tmp_path / "e" / "model.safetensors"))
    assert "lm_head.qweight" in stored and "model.embed_tokens.weight" in stored
    reference = write_dequantized(tmp_path / "e", tmp_path / "reference")
    assert _answers(tmp_path / "e", "float32") == _answers(reference, "float32")


def _tied(tmp_path: Path) -> Path:
    """llama-tiny with its head tied to the embedding, as SmolLM2's is."""
    from safetensors.torch import save_file

    ck = make_checkpoint("llama-tiny", tmp_path / "tied", seed=2)
    config = json.loads((ck / "config.json").read_text())
    (ck / "config.json").write_text(json.dumps(config | {"tie_word_embeddings": True}))
    weights = load_file(str(ck / "model.safetensors"))
    del weights["lm_head.weight"]
    save_file(weights, str(ck / "model.safetensors"), metadata={"format": "pt"})
    return ck


def _model(engine: Path, dtype: str):
    from quanta.frontends.offline import LLM

    return LLM(str(engine), dtype=dtype).engine.runner.model


@pytest.mark.engine
@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_quantized_embedding_is_the_tied_heads_table_stored_once(tmp_path, mode, dtype):
    """--quantize-embedding on a tied model: the table is stored once, quantized, under the
    embedding's name; the head reads it (quantized with it), the lookup reads the head's
    packed rows, and nothing holds a float copy. The engine answers as its dequantized
    twin (fp32: the same greedy tokens; bf16: log-probabilities within bf16's rounding)."""
    from quanta.runner.quantized import resident_weight_bytes
    from quanta.runner.quantized_table import QuantizedEmbedding

    ck = _tied(tmp_path)
    options = _options(dtype=dtype, quantization=mode, quantize_embedding=True)
    m = build_engine_dir(ck, tmp_path / "e", options)
    q = m.quantization
    assert q is not None and q.embedding and q.lm_head and q.lm_head_mode == mode
    stored = load_file(str(tmp_path / "e" / "model.safetensors"))
    assert "model.embed_tokens.qweight" in stored
    assert "model.embed_tokens.weight" not in stored and "lm_head.qweight" not in stored
    model = _model(tmp_path / "e", dtype)
    embedding = model.model.embed_tokens
    assert isinstance(embedding, QuantizedEmbedding) and embedding.shared
    head_only = build_engine_dir(
        ck, tmp_path / "h", _options(dtype=dtype, quantization=mode, quantize_lm_head=True)
    )
    assert not head_only.quantization.embedding
    float_table = 512 * 64 * (4 if dtype == "float32" else 2)
    saved = resident_weight_bytes(_model(tmp_path / "h", dtype)) - resident_weight_bytes(model)
    assert saved == float_table
    reference = write_dequantized(tmp_path / "e", tmp_path / "reference")
    ids = torch.tensor([[1, 7, 300], [511, 0, 7]])
    want = load_file(str(reference / "model.safetensors"))["model.embed_tokens.weight"]
    assert torch.allclose(embedding(ids).float(), want[ids].to(embedding.dtype).float(), atol=2e-3)
    if dtype == "float32":
        assert _answers(tmp_path / "e", dtype) == _answers(reference, dtype)
    else:
        expect = _logprobs(reference, "float32")
        rounding = float((_logprobs(reference, "bfloat16") - expect).abs().max())
        error = float((_logprobs(tmp_path / "e", "bfloat16") - expect).abs().max())
        assert error <= 2 * rounding + 1e-3, (error, rounding)


@pytest.mark.engine
def test_an_untied_models_quantized_embedding_keeps_its_own_table(checkpoint, tmp_path):
    from quanta.runner.quantized_table import QuantizedEmbedding

    options = _options(dtype="float32", quantization="int8", quantize_embedding=True)
    m = build_engine_dir(checkpoint, tmp_path / "e", options)
    assert m.quantization is not None and m.quantization.embedding
    assert not m.quantization.lm_head  # an untied head stays as asked
    stored = load_file(str(tmp_path / "e" / "model.safetensors"))
    assert "model.embed_tokens.qweight" in stored and "lm_head.weight" in stored
    embedding = _model(tmp_path / "e", "float32").model.embed_tokens
    assert isinstance(embedding, QuantizedEmbedding) and not embedding.shared
    reference = write_dequantized(tmp_path / "e", tmp_path / "reference")
    assert _answers(tmp_path / "e", "float32") == _answers(reference, "float32")


@pytest.mark.engine
def test_the_engine_cache_keeps_a_quantized_table_apart(tmp_path):
    """``engine_for_gguf`` (what ``bench peer`` and ``bench quality`` build): the same file
    with and without --quantize-embedding, and with another head mode, are three engines."""
    from quanta.build.engine_cache import engine_for_gguf

    gguf_file = tmp_path / "m.gguf"
    write_gguf(_tied(tmp_path), gguf_file, qtype=Q.Q8_0)
    cache = tmp_path / "cache"
    plain = engine_for_gguf(gguf_file, dtype="float32", quantization="int8", cache=cache)
    table = engine_for_gguf(
        gguf_file, dtype="float32", quantization="int8", embedding=True, cache=cache
    )
    head = engine_for_gguf(
        gguf_file, dtype="float32", quantization="int8", embedding=True, head="int4", cache=cache
    )
    assert len({plain, table, head}) == 3
    assert not read_manifest(plain).quantization.embedding
    q = read_manifest(head).quantization
    assert q.embedding and q.lm_head_mode == "int4"
    again = engine_for_gguf(
        gguf_file, dtype="float32", quantization="int8", embedding=True, cache=cache
    )
    assert again == table


def test_quantize_embedding_needs_a_quantization(checkpoint, tmp_path):
    with pytest.raises(BuildError, match="--quantize-embedding"):
        build_engine_dir(checkpoint, tmp_path / "e", _options(quantize_embedding=True))


def test_the_cli_takes_tensorrt_llms_weight_only_flags(checkpoint, tmp_path):
    from quanta.cli import app
    from typer.testing import CliRunner

    runner = CliRunner()
    base = ["build", str(checkpoint), "--kv-cache-memory", "1MiB", "--host-cache-memory", "0"]
    result = runner.invoke(
        app,
        [*base, "--out", str(tmp_path / "e"), "--use_weight_only", "--weight_only_precision",
         "int4", "--group-size", "32"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "quantization: int4, group 32, asymmetric" in result.output
    m = read_manifest(tmp_path / "e")
    assert m is not None and m.quantization is not None and m.quantization.mode == "int4"
    clash = runner.invoke(
        app,
        [*base, "--out", str(tmp_path / "f"), "--quantization", "int8", "--use-weight-only",
         "--weight-only-precision", "int4"],
    )  # fmt: skip
    assert clash.exit_code != 0 and "contradicts" in clash.output


def test_a_triton_model_can_require_the_engines_quantization(tmp_path):
    from quanta.frontends.triton.settings import parse_parameters

    engine, _ = parse_parameters({"model_dir": "engines/x", "quantization": "int4"}, cwd=tmp_path)
    assert engine.quantization == "int4"


def test_a_product_mixing_quantized_and_float_parts_runs_dequantized(caplog):
    """A GGUF may store q as Q4_1 and v as Q8_0 or a K-quant (dequantized): the fused q/k/v
    cannot be one quantized product, so its parts are dequantized and it runs in float."""
    from quanta.runner.linear import ProjectionFactory, TorchLinear
    from torch import nn

    q = nn.Linear(64, 32, bias=False)
    v = nn.Linear(64, 32, bias=False)
    k = nn.Linear(64, 32, bias=False)
    q.quantized = quantize(q.weight.detach(), "int4", 32, False)
    k.quantized = quantize(k.weight.detach(), "int8", 0, True)
    want = torch.cat([q.quantized.dequantize(), k.quantized.dequantize(), v.weight.detach()])
    product = ProjectionFactory("torch")([q, k, v])
    assert isinstance(product, TorchLinear)
    assert "mixes" in caplog.text
    x = torch.randn(3, 64)
    assert torch.allclose(product(x), x @ want.T, atol=1e-5)


def test_the_head_can_take_another_mode_than_the_layers(checkpoint, tmp_path):
    m = build_engine_dir(
        checkpoint,
        tmp_path / "e",
        _options(quantization="int4", quantize_lm_head=True, lm_head_quantization="int8"),
    )
    assert m.quantization is not None
    assert (m.quantization.mode, m.quantization.lm_head_mode) == ("int4", "int8")
    stored = load_file(str(tmp_path / "e" / "model.safetensors"))
    assert stored["lm_head.qweight"].dtype == torch.int8
    assert stored["model.layers.0.mlp.gate_proj.qweight"].dtype == torch.uint8


# -- what the file stores -------------------------------------------------------------------
@pytest.mark.parametrize(("mode", "symmetric"), [("int4", False), ("int4", True), ("int8", True)])
def test_stored_scales_and_mins_are_as_narrow_as_served_and_read_back_exactly(mode, symmetric):
    """int4 scales and mins are stored in fp16 (what ``native-int4`` reads) and per-channel
    int8 scales in fp32 (what ``native-int8`` multiplies by); the weight read back is the
    one quantized, bit for bit. A format-1 engine's fp32 scales and ``zeros`` read the same."""
    w = quantize(_weight(), mode, 32, symmetric)
    stored = w.tensors()
    assert stored["scales"].dtype == (torch.float16 if mode == "int4" else torch.float32)
    assert ("mins" in stored) == (mode == "int4" and not symmetric)
    assert "zeros" not in stored
    assert torch.equal(QuantizedWeight.from_tensors(stored).dequantize(), w.dequantize())
    old = {"qweight": w.qweight, "scales": w.scales} | (
        {} if w.zeros is None else {"zeros": w.zeros}
    )
    assert torch.equal(QuantizedWeight.from_tensors(old).dequantize(), w.dequantize())


def test_a_scale_fp16_would_move_is_refused_rather_than_stored():
    w = quantize(_weight(), "int4", 32, True)
    moved = QuantizedWeight("int4", w.qweight, w.scales * (1 + 2**-14), None)
    with pytest.raises(ValueError, match="fp16"):
        moved.tensors()


@pytest.mark.engine
@pytest.mark.parametrize("quantization", ["keep", "int4"])
def test_a_ggufs_q8_0_table_is_stored_as_codes_and_answers_as_its_float_twin(
    tmp_path, quantization
):
    """SmolLM2's GGUF layout: Q4_1 linears and a Q8_0 token embedding the head is tied to.
    The engine stores the table's int8 codes and fp16 block scales, as the file does (no
    float copy on disk); a lookup dequantizes the rows it reads, and the tied head holds the
    table dequantized at load (no kernel reads grouped int8 faster). fp32: the answers equal
    the dequantized twin's; bf16: the embedding rows and the head's logits are the float
    table's, rounded once."""
    from quanta.runner.quantized_table import QuantizedEmbedding

    path = tmp_path / "m.gguf"
    expected = write_gguf(_tied(tmp_path), path, qtype=Q.Q4_1, embedding_qtype=Q.Q8_0)
    engine = tmp_path / "e"
    m = build_engine_dir(path, engine, _options(dtype="float32", quantization=quantization))
    q = m.quantization
    assert q is not None and q.mode == "int4" and q.kept["Q8_0"] == 1 and not q.dequantized
    assert not q.embedding  # --quantize-embedding's record: the table was not re-quantized
    stored = load_file(str(engine / "model.safetensors"))
    assert stored["model.embed_tokens.qweight"].dtype == torch.int8
    assert stored["model.embed_tokens.scales"].dtype == torch.float16
    assert "model.embed_tokens.weight" not in stored and "lm_head.weight" not in stored
    reference = write_dequantized(engine, tmp_path / "reference")
    assert _answers(engine, "float32") == _answers(reference, "float32")
    build_engine_dir(path, tmp_path / "b", _options(dtype="bfloat16", quantization=quantization))
    model = _model(tmp_path / "b", "bfloat16")
    embedding, head = model.model.embed_tokens, model.lm_head
    assert isinstance(embedding, QuantizedEmbedding) and not embedding.shared
    assert not isinstance(head, QuantizedLinear)
    table = torch.from_numpy(expected["model.embed_tokens.weight"]).to(torch.bfloat16)
    ids = torch.tensor([0, 5, 17, 5, table.shape[0] - 1])
    assert torch.equal(embedding(ids), table[ids])
    x = torch.randn(3, table.shape[1], generator=torch.Generator().manual_seed(1))
    x = x.to(torch.bfloat16)
    want = (x.float() @ table.float().T).to(torch.bfloat16)
    assert torch.allclose(head(x).float(), want.float(), rtol=2**-7, atol=1e-3)


@pytest.mark.engine
def test_a_ggufs_q4_0_table_is_the_tied_heads_and_stored_once(tmp_path):
    """A Q4_0 token embedding tied to the head: kept, and the head's int4 product reads
    it, the lookup reading the head's packed rows: no float table on disk or in memory."""
    from quanta.runner.quantized_table import QuantizedEmbedding

    path = tmp_path / "m.gguf"
    expected = write_gguf(_tied(tmp_path), path, qtype=Q.Q4_0)
    engine = tmp_path / "e"
    m = build_engine_dir(path, engine, _options(dtype="bfloat16", quantization="keep"))
    assert m.quantization is not None and not m.quantization.dequantized
    stored = load_file(str(engine / "model.safetensors"))
    assert stored["model.embed_tokens.qweight"].dtype == torch.uint8
    assert "model.embed_tokens.weight" not in stored and "lm_head.weight" not in stored
    model = _model(engine, "bfloat16")
    embedding, head = model.model.embed_tokens, model.lm_head
    assert isinstance(head, QuantizedLinear)
    assert isinstance(embedding, QuantizedEmbedding)
    assert embedding.shared == (head.kernel in quantized.ROW_KERNELS)
    table = torch.from_numpy(expected["model.embed_tokens.weight"]).to(torch.bfloat16)
    ids = torch.tensor([0, 5, 17, 5, table.shape[0] - 1])
    assert torch.equal(embedding(ids), table[ids])
    reference = write_dequantized(engine, tmp_path / "reference")
    want = _logprobs(reference, "float32")
    rounding = float((_logprobs(reference, "bfloat16") - want).abs().max())
    error = float((_logprobs(engine, "bfloat16") - want).abs().max())
    assert error <= 2 * rounding + 1e-3, (error, rounding)


@pytest.mark.engine
def test_the_engine_cache_rebuilds_an_engine_an_older_quanta_wrote(tmp_path):
    """A cached engine of an older format (fp32 scales, a float table) still loads, but
    ``engine_for_gguf`` rebuilds it in today's layout rather than serve it."""
    from quanta.build.engine_cache import engine_for_gguf
    from quanta.build.manifest import ENGINE_FORMAT

    gguf_file = tmp_path / "m.gguf"
    write_gguf(_tied(tmp_path), gguf_file, qtype=Q.Q4_1, embedding_qtype=Q.Q8_0)
    cache = tmp_path / "cache"
    engine = engine_for_gguf(gguf_file, dtype="float32", quantization="keep", cache=cache)
    path = engine / "quanta_engine.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | {"format": 1}))
    assert engine_for_gguf(gguf_file, dtype="float32", quantization="keep", cache=cache) == engine
    manifest = read_manifest(engine)
    assert manifest is not None and manifest.format == ENGINE_FORMAT


@pytest.mark.engine
def test_a_quantized_engine_rebuilds_with_its_mode_named(tmp_path):
    """An engine's quantized tensors (OPT's tied head included, which lives apart from
    ``model.decoder.embed_tokens``) are read back as already quantized when the mode is named;
    without it the build says which flag it needs instead of guessing the format."""
    ck = make_checkpoint("opt-tiny", tmp_path / "opt", seed=3)
    options = _options(dtype="float32", quantization="int8", quantize_lm_head=True)
    build_engine_dir(ck, tmp_path / "e", options)
    assert "lm_head.qweight" in load_file(str(tmp_path / "e" / "model.safetensors"))
    again = build_engine_dir(tmp_path / "e", tmp_path / "again", options)
    assert again.quantization is not None and again.quantization.lm_head
    assert _answers(tmp_path / "again", "float32") == _answers(tmp_path / "e", "float32")
    with pytest.raises(BuildError, match="--quantization int8 or int4"):
        build_engine_dir(tmp_path / "e", tmp_path / "unnamed", _options(dtype="float32"))


@pytest.mark.engine
@pytest.mark.parametrize("preset", ["opt-tiny", "llama-tiny"])
def test_an_fp32_engine_holds_its_checkpoints_bytes_once(preset, tmp_path):
    """fp32 weights are used as stored, and a tied head reads the embedding's table: what the
    engine holds is what the checkpoint holds, counted once."""
    from quanta.runner.quantized import resident_weight_bytes

    ck = make_checkpoint(preset, tmp_path / preset, seed=1)
    stored = load_file(str(ck / "model.safetensors"))
    build_engine_dir(ck, tmp_path / "e", _options(dtype="float32"))
    want = sum(t.numel() * 4 for t in stored.values())
    assert resident_weight_bytes(_model(tmp_path / "e", "float32")) == want
