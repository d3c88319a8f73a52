"""The engine's speed paths keep its answers: prepacked oneDNN linears against torch's, bf16
against HF transformers in bf16 (within a stated tolerance, not bit equality), the three
decode-attention kernels against each other (reading only each row's own slots), and the
rules that pick the default dtype and kernels on each machine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from quanta.runner import ModelRunner, decode_kernel, model_runner, native_decode, panel_linear
from quanta.runner import cpu as cpu_module
from quanta.runner.attention import DecodeBatch
from quanta.runner.decode_kernel import row_by_row_decode, varlen_decode
from quanta.runner.layer_ops import NativeLayerOps, TorchLayerOps, layer_ops
from quanta.runner.linear import PackedLinear, PanelLinear, onednn_supports, resolve_kernel
from runner_helpers import build_hf_checkpoint
from torch import nn

pytestmark = pytest.mark.engine

CPU = torch.device("cpu")
needs_onednn = pytest.mark.skipif(
    not onednn_supports(torch.float32, CPU), reason="torch has no oneDNN here"
)
needs_bf16 = pytest.mark.skipif(
    not onednn_supports(torch.bfloat16, CPU), reason="this CPU's oneDNN runs no bf16"
)
PROMPTS = [[5, 17, 42, 8, 99, 3, 250, 11], list(range(3, 40)), [7]]


@pytest.fixture(scope="module", params=["opt", "llama"])
def checkpoint(request, tmp_path_factory) -> tuple[Path, Any]:
    path = tmp_path_factory.mktemp(request.param)
    return path, build_hf_checkpoint(request.param, path, seed=3)


def runner(path: Path, **kwargs: Any) -> ModelRunner:
    return ModelRunner(path, num_device_blocks=16, num_host_blocks=0, **kwargs)


@needs_onednn
def test_packed_linears_replace_every_projection_and_match_torch(checkpoint):
    path, _ = checkpoint
    packed = runner(path, dtype="float32", linear_kernel="onednn")
    plain = runner(path, dtype="float32", linear_kernel="torch")
    assert packed.linear_kernel == "onednn" and plain.linear_kernel == "torch"
    assert not any(isinstance(m, nn.Linear) for m in packed.model.modules())
    assert any(isinstance(m, PackedLinear) for m in packed.model.modules())
    # the unpacked weights are gone: no projection keeps a second copy
    assert not any(name.endswith("proj.weight") for name, _ in packed.model.named_parameters())
    for prompt in PROMPTS:
        for chunk in (None, 3):
            a = packed.forward_logits(prompt, chunk_size=chunk)
            b = plain.forward_logits(prompt, chunk_size=chunk)
            assert (a - b).abs().max().item() < 1e-4


@needs_onednn
@pytest.mark.parametrize("rows", [1, 3, 4, 9, 65])
@pytest.mark.parametrize("activation", ["none", "relu"])
def test_fp32_packed_linear_matches_torch_at_few_and_many_rows(rows, activation):
    """Up to 64 fp32 rows run the few-rows kernel (``test_fp32_rows.py``), or where it cannot
    be built up to three run torch's own product (the same bits as ``F.linear``); more run
    oneDNN's. Either way the product, its ReLU and its residual add are F.linear's."""
    from quanta.runner import fp32_rows

    gen = torch.Generator().manual_seed(rows)
    weight, bias = torch.randn(48, 32, generator=gen), torch.randn(48, generator=gen)
    x, residual = torch.randn(rows, 32, generator=gen), torch.randn(rows, 48, generator=gen)
    packed = PackedLinear(weight, bias, activation)
    want = F.linear(x, weight, bias)
    got = packed(x)
    want_act = torch.relu(want) if activation == "relu" else want
    if rows <= 3 and fp32_rows.load() is None:
        assert torch.equal(got, want_act)
    torch.testing.assert_close(got, want_act)
    if activation == "none":
        torch.testing.assert_close(packed.add(x, residual), want + residual)


@needs_bf16
def test_bf16_agrees_with_hf_in_bf16(checkpoint):
    """Tolerance: the two compute in bf16 with different kernels and rounding points, so
    logits may differ by a few bf16 steps of their scale; the argmax of at least 90% of
    positions must agree."""
    path, hf = checkpoint
    ours = runner(path, dtype="bfloat16")
    hf_bf16 = hf.to(torch.bfloat16)
    try:
        agree = total = 0
        for prompt in PROMPTS:
            got = ours.forward_logits(prompt)
            with torch.no_grad():
                want = hf_bf16(torch.tensor([prompt])).logits[0].float()
            scale = want.abs().max().item()
            assert (got - want).abs().max().item() < 0.05 * scale
            agree += int((got.argmax(-1) == want.argmax(-1)).sum())
            total += len(prompt)
        assert agree >= 0.9 * total
    finally:
        hf.to(torch.float32)


def test_default_dtype_is_the_machines_fastest(monkeypatch):
    monkeypatch.delenv(model_runner.DEFAULT_DTYPE_ENV, raising=False)
    cpu_module.cpu_flags.cache_clear()
    monkeypatch.setattr(model_runner, "has_fast_bf16", lambda: False)
    assert model_runner.default_dtype(CPU) == torch.float32
    monkeypatch.setattr(model_runner, "has_fast_bf16", lambda: True)
    expected = torch.bfloat16 if onednn_supports(torch.bfloat16, CPU) else torch.float32
    assert model_runner.default_dtype(CPU) == expected
    assert model_runner.default_dtype(torch.device("cuda")) == torch.float16
    assert model_runner.resolve_dtype("float32", CPU) == torch.float32  # explicit wins
    monkeypatch.setenv(model_runner.DEFAULT_DTYPE_ENV, "float32")
    assert model_runner.default_dtype(CPU) == torch.float32
    monkeypatch.setenv(model_runner.DEFAULT_DTYPE_ENV, "fp8")
    with pytest.raises(ValueError, match="QUANTA_DEFAULT_DTYPE='fp8' is not a dtype"):
        model_runner.default_dtype(CPU)


def test_cpu_isa_names_a_path():
    assert cpu_module.cpu_isa()  # amx_bf16, avx512_bf16, avx512f, avx2 or the machine's name


def test_linear_kernel_rule():
    cuda = torch.device("cuda")
    assert resolve_kernel("auto", torch.float16, cuda) == "torch"
    assert resolve_kernel("torch", torch.float32, CPU) == "torch"
    with pytest.raises(ValueError, match="linear_kernel=onednn needs a CPU"):
        resolve_kernel("onednn", torch.float16, cuda)
    if onednn_supports(torch.float32, CPU):
        assert resolve_kernel("auto", torch.float32, CPU) == "onednn"
    # the panel kernel runs bf16 only, and auto picks it wherever it runs
    with pytest.raises(ValueError, match="linear_kernel=native needs bf16"):
        resolve_kernel("native", torch.float32, CPU)
    if panel_linear.supports(torch.bfloat16, CPU):
        assert resolve_kernel("auto", torch.bfloat16, CPU) == "native"
    elif onednn_supports(torch.bfloat16, CPU):
        assert resolve_kernel("auto", torch.bfloat16, CPU) == "onednn"


needs_panel = pytest.mark.skipif(
    not panel_linear.supports(torch.bfloat16, CPU), reason="no AVX512_BF16 or no C compiler"
)


def _bf16_reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """The product in fp64 from the bf16 inputs: what a bf16 kernel rounds once."""
    y = x.double() @ w.double().T
    return y if b is None else y + b.double()


@needs_panel
@pytest.mark.parametrize("rows", [0, 1, 2, 3, 4, 5, 8, 33, 97])
@pytest.mark.parametrize(("n", "k"), [(64, 64), (130, 37), (5, 3), (960, 576), (64, 1)])
@pytest.mark.parametrize("bias", [False, True])
def test_panel_kernel_rounds_the_exact_product_once(rows, n, k, bias):
    """Every shape the kernel pads (n not a multiple of its 64-column panels, odd k, row
    counts around its 4-row groups) gives the exact product rounded to bf16, give or take one
    bf16 step (its fp32 sums run in another order than an exact sum)."""
    gen = torch.Generator().manual_seed(rows * 1000 + n + k)
    w = torch.randn(n, k, generator=gen).bfloat16()
    x = torch.randn(rows, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16() if bias else None
    layer = PanelLinear(w, b, "none", panel_linear.load())
    got = layer(x)
    assert got.shape == (rows, n) and got.dtype == torch.bfloat16
    want = _bf16_reference(x, w, b)
    step = want.abs().clamp_min(1e-2) * 2.0**-7  # one bf16 step of each value
    assert ((got.double() - want).abs() <= step + 1e-6 * k).all()
    relu = PanelLinear(w, b, "relu", panel_linear.load())
    assert torch.equal(relu(x), torch.relu(got))


@needs_panel
def test_panel_kernel_gives_a_row_the_same_bits_at_every_batch_from_5_rows():
    """From 5 rows the product runs one way for every row count: AMX tiles where the CPU
    has them (one block of 16 rows, or pairs of blocks sharing each panel strip), pair dot
    products elsewhere; either way a row's bits do not depend on the rows beside it."""
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(300, 576, generator=gen).bfloat16()
    x = torch.randn(70, 576, generator=gen).bfloat16()
    layer = PanelLinear(w, torch.randn(300, generator=gen).bfloat16(), "none", panel_linear.load())
    whole = layer(x)
    for rows in (5, 16, 17, 31, 32, 33, 48, 49):
        assert torch.equal(layer(x[:rows]), whole[:rows])
        assert torch.equal(layer(x[-rows:]), whole[-rows:])


@needs_panel
def test_panel_kernel_rows_past_its_row_blocks_keep_their_bits_and_fused_relu():
    """A long prefill passes over the panels 512 rows at a time (a short tail joins the
    block before it): a row's bits are the same at any row count, and the ReLU riding on
    the product equals torch's ReLU after it."""
    gen = torch.Generator().manual_seed(11)
    w = torch.randn(130, 96, generator=gen).bfloat16()
    b = torch.randn(130, generator=gen).bfloat16()
    x = torch.randn(1100, 96, generator=gen).bfloat16()
    layer = PanelLinear(w, b, "none", panel_linear.load())
    relu = PanelLinear(w, b, "relu", panel_linear.load())
    whole = layer(x)
    for rows in (5, 511, 512, 513, 516, 517, 1024, 1028, 1029):
        assert torch.equal(layer(x[:rows]), whole[:rows])
        assert torch.equal(layer(x[-rows:]), whole[-rows:])
    assert torch.equal(relu(x), torch.relu(whole))


@needs_panel
def test_panel_kernel_matches_onednn_and_keeps_one_copy(checkpoint):
    """The engine's bf16 products through the panel kernel agree with oneDNN's as two bf16
    kernels can (a few bf16 steps of the logits' scale), and only the packed weight stays."""
    path, _ = checkpoint
    native = runner(path, dtype="bfloat16", linear_kernel="native")
    packed = runner(path, dtype="bfloat16", linear_kernel="onednn")
    assert native.linear_kernel == "native"
    assert any(isinstance(m, PanelLinear) for m in native.model.modules())
    assert not any(isinstance(m, nn.Linear | PackedLinear) for m in native.model.modules())
    assert not any(name.endswith("proj.weight") for name, _ in native.model.named_parameters())
    for prompt in PROMPTS:
        a, b = native.forward_logits(prompt), packed.forward_logits(prompt)
        assert (a - b).abs().max().item() < 0.05 * b.abs().max().item()


# --- decode attention: the native kernel, SDPA row by row and varlen_decode agree -----------


def _decode_case(
    lens: list[int], heads: int, kv_heads: int, dtype: torch.dtype, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, DecodeBatch]:
    """Random rows over a NaN-filled cache in which only the rows' own slots hold values, in
    scattered order, as a paged cache holds them after other requests came and went."""
    gen = torch.Generator().manual_seed(seed)
    dim, num_slots = 32, 4 * sum(lens)
    cache = torch.full((2, num_slots, kv_heads, dim), float("nan"), dtype=dtype)
    slots = torch.randperm(num_slots, generator=gen)[: sum(lens)]
    cache[:, slots] = (torch.randn(2, len(slots), kv_heads, dim, generator=gen) * 3).to(dtype)
    rows = torch.randn(len(lens), heads, dim, generator=gen).to(dtype)
    lens_t = torch.tensor(lens)
    batch = DecodeBatch(
        token_index=torch.arange(len(lens)),
        slots=slots,
        owner=torch.arange(len(lens)).repeat_interleave(lens_t),
        kernel=None,  # type: ignore[arg-type]
        lens=tuple(lens),
        bounds=torch.cat((torch.zeros(1, dtype=torch.long), lens_t.cumsum(0))),
    )
    return rows, cache, batch


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (8, 2)])
@pytest.mark.parametrize("lens", [[1], [5, 1, 40, 17], [3, 9, 1, 30, 2, 8, 16, 7, 21, 11]])
def test_decode_kernels_agree_and_read_only_their_slots(lens, heads, kv_heads, dtype):
    native = native_decode.load()
    if native is None:
        pytest.skip("no C compiler here")
    rows, cache, batch = _decode_case(lens, heads, kv_heads, dtype)
    with torch.inference_mode():
        want = varlen_decode(rows, cache[0], cache[1], batch.slots, batch.owner, 0.3).float()
        sdpa = row_by_row_decode(rows, cache[0], cache[1], batch, 0.3).float()
        got = native(rows, cache[0], cache[1], batch.slots, batch.bounds, 0.3).float()
    assert not want.isnan().any(), "a stale (NaN) slot was read"
    # bf16: the kernels round at different points (SDPA keeps bf16 probabilities), so a few
    # bf16 steps of the values' scale (about 3 here) apart
    tolerance = {"atol": 1e-5, "rtol": 1e-5}
    if dtype == torch.bfloat16:
        tolerance = {"atol": 3e-2, "rtol": 1.6e-2}
    torch.testing.assert_close(got.to(dtype), want.to(dtype), **tolerance)
    torch.testing.assert_close(sdpa.to(dtype), want.to(dtype), **tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [24, 80])
def test_native_decode_reads_head_sizes_off_its_vector_width(dtype, dim):
    """Head sizes that are no multiple of 16 (slot by slot) or of 64 (the weighted sum's
    tail), over contexts that end inside a block of 16 slots: as the einsum computes it."""
    native = native_decode.load()
    if native is None:
        pytest.skip("no C compiler here")
    gen = torch.Generator().manual_seed(2)
    lens, heads, kv_heads = [1, 17, 40], 6, 2
    cache = (torch.randn(2, 4 * sum(lens), kv_heads, dim, generator=gen)).to(dtype)
    slots = torch.randperm(4 * sum(lens), generator=gen)[: sum(lens)]
    rows = torch.randn(len(lens), heads, dim, generator=gen).to(dtype)
    bounds = torch.cat((torch.zeros(1, dtype=torch.long), torch.tensor(lens).cumsum(0)))
    with torch.inference_mode():
        got = native(rows, cache[0], cache[1], slots, bounds, 0.3)
    for b in range(len(lens)):
        own = slots[bounds[b] : bounds[b + 1]]
        keys = cache[0, own].float().repeat_interleave(heads // kv_heads, dim=1)
        vals = cache[1, own].float().repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.einsum("hd,lhd->hl", rows[b].float(), keys) * 0.3
        want = torch.einsum("hl,lhd->hd", scores.softmax(-1), vals)
        tolerance = {"atol": 2e-2, "rtol": 1e-2} if dtype == torch.bfloat16 else {}
        torch.testing.assert_close(got[b].float(), want, **tolerance)


def test_native_decode_softmax_survives_extreme_scores():
    """Scores far apart (exp underflows for all but the peak) and a NaN in a row's own value
    propagate as softmax defines them."""
    native = native_decode.load()
    if native is None:
        pytest.skip("no C compiler here")
    rows, cache, batch = _decode_case([6, 6], 2, 2, torch.float32, seed=1)
    rows[0] *= 1e4  # row 0: one slot dominates every other by far more than exp's range
    with torch.inference_mode():
        want = varlen_decode(rows, cache[0], cache[1], batch.slots, batch.owner, 1.0)
        got = native(rows, cache[0], cache[1], batch.slots, batch.bounds, 1.0)
        assert torch.allclose(got, want, atol=1e-5) and not got.isnan().any()
        cache[1, batch.slots[7]] = float("nan")  # row 1's own value
        got = native(rows, cache[0], cache[1], batch.slots, batch.bounds, 1.0)
    assert got[1].isnan().all() and not got[0].isnan().any()


def test_native_decode_refuses_layouts_it_cannot_read():
    native = native_decode.load()
    if native is None:
        pytest.skip("no C compiler here")
    rows, cache, batch = _decode_case([3, 4], 4, 2, torch.float32)
    with pytest.raises(ValueError, match="unsupported layout or dtype"):
        native(rows.double(), cache[0], cache[1], batch.slots, batch.bounds, 1.0)
    with pytest.raises(ValueError, match="unsupported layout or dtype"):
        native(rows, cache[0].transpose(1, 2), cache[1], batch.slots, batch.bounds, 1.0)


def test_attention_kernel_rule(monkeypatch):
    monkeypatch.delenv(decode_kernel.ATTENTION_KERNEL_ENV, raising=False)
    resolve = decode_kernel.resolve_attention_kernel
    assert resolve("eager", CPU) == "eager"  # explicit wins
    assert resolve("auto", torch.device("cuda"), torch.float16) == "eager"
    monkeypatch.setattr(native_decode, "compiler", lambda: "/usr/bin/cc")
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert resolve("auto", CPU, torch.bfloat16) == "native"
    assert resolve("auto", CPU, torch.float16) != "native"  # fp32 and bf16 only
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)  # faster than compiled there too
    assert resolve("auto", CPU, torch.float32) == "native"
    monkeypatch.setattr(native_decode, "compiler", lambda: None)
    assert resolve("auto", CPU, torch.float32) in ("compiled", "eager")
    monkeypatch.setenv(decode_kernel.ATTENTION_KERNEL_ENV, "native")
    assert resolve("auto", CPU) == "native"
    monkeypatch.setenv(decode_kernel.ATTENTION_KERNEL_ENV, "fast")
    with pytest.raises(ValueError, match="QUANTA_ATTENTION_KERNEL='fast'"):
        resolve("auto", CPU)


def test_native_kernel_falls_back_without_a_compiler(monkeypatch, caplog):
    monkeypatch.setattr(native_decode, "compiler", lambda: None)
    monkeypatch.setattr(decode_kernel, "_compile", _no_compiler)
    kernel, name = decode_kernel.decode_kernel(
        "native", heads=4, kv_heads=2, head_dim=16, dtype=torch.float32
    )
    assert name == "eager"
    assert "no C compiler found" in caplog.text
    rows, cache, batch = _decode_case([2, 9], 4, 2, torch.float32)
    with torch.inference_mode():
        got = kernel(rows, cache[0], cache[1], batch, 1.0)
    assert not got.isnan().any()


def _no_compiler() -> None:
    raise RuntimeError("no C++ compiler")


def test_native_build_is_cached_per_source_and_cpu(tmp_path, monkeypatch):
    if native_decode.compiler() is None:
        pytest.skip("no C compiler here")
    monkeypatch.setenv(native_decode.KERNEL_CACHE_ENV, str(tmp_path))
    assert native_decode.load() is not None
    built = list(tmp_path.glob("paged_decode-*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    assert native_decode.load() is not None  # found, not built again
    assert built[0].stat().st_mtime_ns == stamp
    monkeypatch.setattr(native_decode, "cpu_flags", lambda: frozenset({"another-cpu"}))
    assert native_decode.load() is not None
    assert len(list(tmp_path.glob("paged_decode-*.so"))) == 2


# --- the layer's small operations: the C kernels against torch's operators ------------------


needs_native_ops = pytest.mark.skipif(
    not isinstance(layer_ops(CPU), NativeLayerOps), reason="no C compiler: torch ops only"
)


@needs_native_ops
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 17])
def test_native_layer_ops_round_as_torch_does(dtype, rows):
    """bf16: bit-identical to torch's operators (the kernels round where they round); fp32:
    within the last bits (sums and exp computed in another order or by another library).
    Widths that are no multiple of a vector (1537) and non-finite values included."""
    native, torch_ops = layer_ops(CPU), TorchLayerOps()
    gen = torch.Generator().manual_seed(rows)
    gate_up = (torch.randn(rows, 2 * 1537, generator=gen) * 6).to(dtype)
    gate_up[0, 5], gate_up[0, 1537 + 7], gate_up[0, 9] = float("nan"), float("inf"), -1e30
    if native.name == "native" and getattr(native, "_silu_mul", None) is not None:
        got, want = native.silu_mul(gate_up), torch_ops.silu_mul(gate_up)
        assert torch.equal(got.isnan(), want.isnan())
        got, want = got.nan_to_num(), want.nan_to_num()
        if dtype == torch.bfloat16:
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    x = (torch.randn(rows, 577, generator=gen) * 50).to(dtype)
    residual = torch.randn(rows, 577, generator=gen).to(dtype)
    weight = torch.randn(577, generator=gen).to(dtype)
    r1, r2 = residual.clone(), residual.clone()
    got, want = native.rms_norm(x, r1, weight, 1e-5), torch_ops.rms_norm(x, r2, weight, 1e-5)
    assert torch.equal(r1, r2)  # the residual stream, written back by both
    if dtype == torch.bfloat16:
        # the normalising sum is added up in another order: at most one bf16 step apart
        assert ((got.float() - want.float()).abs() <= want.float().abs() * 2**-7 + 1e-6).all()
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@needs_native_ops
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "heads", "head_dim"), [(1, 12, 64), (17, 3, 40), (96, 5, 128)])
def test_native_rope_rounds_as_torch_does(dtype, rows, heads, head_dim):
    """The rotary embedding in place on a fused product's q and k heads (a row stride wider
    than the heads it rotates): bit-identical to torch's operators in bf16, within the last
    bits in fp32; widths that are no multiple of a vector (half of 40) and non-finite values
    included."""
    native, torch_ops = layer_ops(CPU), TorchLayerOps()
    gen = torch.Generator().manual_seed(rows + heads)
    fused = (torch.randn(rows, (heads + 2) * head_dim, generator=gen) * 8).to(dtype)
    fused[0, 3], fused[0, head_dim + 1] = float("nan"), float("inf")
    angles = torch.randn(rows, head_dim, generator=gen) * 3
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    a, b = fused.clone(), fused.clone()
    native.rope_(a[:, : heads * head_dim].view(rows, heads, head_dim), cos, sin)
    torch_ops.rope_(b[:, : heads * head_dim].view(rows, heads, head_dim), cos, sin)
    assert torch.equal(a.isnan(), b.isnan())
    a, b = a.nan_to_num(), b.nan_to_num()
    if dtype == torch.bfloat16:
        assert torch.equal(a, b)
    else:
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert torch.equal(a[:, heads * head_dim :], fused[:, heads * head_dim :].nan_to_num())


@needs_native_ops
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_rope_rotates_a_partial_share_of_each_head(dtype):
    """A partial rotation (Phi-4-mini's): the first 24 of each 64-wide head turn, as torch's
    operators turn them, and the rest of the head is left as it was."""
    native, torch_ops = layer_ops(CPU), TorchLayerOps()
    gen = torch.Generator().manual_seed(7)
    rows, heads, head_dim, rotated = 5, 6, 64, 24
    fused = (torch.randn(rows, heads * head_dim, generator=gen) * 8).to(dtype)
    angles = torch.randn(rows, rotated, generator=gen) * 3
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    a, b = fused.clone(), fused.clone()
    native.rope_(a.view(rows, heads, head_dim)[..., :rotated], cos, sin)
    torch_ops.rope_(b.view(rows, heads, head_dim)[..., :rotated], cos, sin)
    if dtype == torch.bfloat16:
        assert torch.equal(a, b)
    else:
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    rest = (slice(None), slice(None), slice(rotated, None))
    assert torch.equal(a.view(rows, heads, head_dim)[rest], fused.view(rows, heads, head_dim)[rest])


def _within_bf16_steps(
    got: torch.Tensor, want: torch.Tensor, steps: int, atol: float | torch.Tensor = 1e-6
) -> bool:
    """``got`` at most ``steps`` bf16 rounding steps of ``want``'s magnitude (or ``atol``)
    from it."""
    got, want = got.float(), want.float()
    return bool(((got - want).abs() <= want.abs() * steps * 2**-8 + atol).all())


@needs_native_ops
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 17])
def test_native_gemma_norm_layer_norm_geglu_and_relu_agree_with_torch(dtype, rows):
    """Gemma's (1 + w) RMSNorm, LayerNorm with bias, GELU(tanh) * up and ReLU: the residual
    stream bit-identical, the results within a bf16 step or two (each rounds where torch
    does, from fp32 values computed in another order) or the last fp32 bits; ReLU exact."""
    native, torch_ops = layer_ops(CPU), TorchLayerOps()
    gen = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 577, generator=gen) * 50).to(dtype)
    residual = torch.randn(rows, 577, generator=gen).to(dtype)
    weight, bias = (torch.randn(2, 577, generator=gen) * 2).to(dtype)
    close = {"rtol": 1e-5, "atol": 1e-5}
    # a step of the larger of the two terms the bias adds: their sum may cancel
    biased = 2**-8 * bias.float().abs()
    for norm, atol in (
        (lambda ops, r: ops.rms_norm(x, r, weight, 1e-6, 1.0), 1e-6),
        (lambda ops, r: ops.layer_norm(x, r, weight, bias, 1e-5), biased),
        (lambda ops, r: ops.layer_norm(x, None, weight, bias, 1e-5), biased),
    ):
        r1, r2 = residual.clone(), residual.clone()
        got, want = norm(native, r1), norm(torch_ops, r2)
        assert torch.equal(r1, r2)
        if dtype == torch.bfloat16:
            assert _within_bf16_steps(got, want, 1, atol)
        else:
            torch.testing.assert_close(got, want, **close)
    gate_up = (torch.randn(rows, 2 * 1537, generator=gen) * 4).to(dtype)
    # tanh is computed by another library: where it nears -1 (gate below -4) the results
    # are some 1e-7 apart, 0 on one side
    got, want = native.gelu_tanh_mul(gate_up), torch_ops.gelu_tanh_mul(gate_up)
    if dtype == torch.bfloat16:  # two roundings, either may land a step apart
        assert _within_bf16_steps(got, want, 2, atol=1e-5)
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    h = gate_up.clone()
    h[0, :3] = torch.tensor([float("nan"), -0.0, float("-inf")])
    got, want = native.relu_(h.clone()), torch_ops.relu_(h.clone())
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(), want.nan_to_num())
    assert torch.equal(got.signbit(), want.signbit())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("window", "softcap"), [(5, None), (0, 5.0), (7, 2.0), (100, None)])
def test_native_decode_attends_over_a_sliding_window_with_soft_capped_scores(
    dtype, window, softcap
):
    """Each row over its last ``window`` slots only (all with 0 or a wider window), its
    scaled scores soft-capped: as HF's eager sequence computes it, row by row."""
    native = native_decode.load()
    if native is None:
        pytest.skip("no C compiler here")
    rows, cache, batch = _decode_case([1, 6, 40, 17], 8, 2, dtype, seed=3)
    with torch.inference_mode():
        got = native(rows, cache[0], cache[1], batch.slots, batch.bounds, 0.3, window, softcap)
    bounds = batch.bounds.tolist()
    for b in range(len(batch.lens)):
        slots = batch.slots[bounds[b] : bounds[b + 1]]
        slots = slots[-window:] if window else slots
        keys = cache[0, slots].float().repeat_interleave(4, dim=1)  # [L, H, D]
        vals = cache[1, slots].float().repeat_interleave(4, dim=1)
        scores = torch.einsum("hd,lhd->hl", rows[b].float(), keys) * 0.3
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        want = torch.einsum("hl,lhd->hd", scores.softmax(-1), vals)
        tolerance = {"atol": 2e-2, "rtol": 1e-2} if dtype == torch.bfloat16 else {}
        torch.testing.assert_close(got[b].float(), want, **tolerance)


@needs_native_ops
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_kv_store_writes_what_index_copy_writes(dtype):
    """K and V as the layers hand them over (strided views into the fused qkv product) land
    in the same cache rows as torch's index_copy_ puts them, and nothing else moves; a slot
    outside the cache is refused before anything is written."""
    native, torch_ops = layer_ops(CPU), TorchLayerOps()
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(37, 12 * 8 + 2 * 3 * 8, generator=gen).to(dtype)
    k = qkv[:, 96:120].view(37, 3, 8)
    v = qkv[:, 120:].view(37, 3, 8)
    slots = torch.randperm(80, generator=gen)[:37]
    cache = torch.randn(2, 80, 3, 8, generator=gen).to(dtype)
    got, want = cache.clone(), cache.clone()
    native.store_kv_(got, slots, k, v)
    torch_ops.store_kv_(want, slots, k, v)
    assert torch.equal(got, want)
    bad = slots.clone()
    bad[20] = 80
    before = got.clone()
    with pytest.raises(IndexError, match="80"):
        native.store_kv_(got, bad, k, v)
    assert torch.equal(got, before)
    # a layout the kernel does not read (heads not one run per token) takes index_copy_
    native.store_kv_(got, slots, k.transpose(1, 2).contiguous().transpose(1, 2), v)
    assert torch.equal(got, want)
