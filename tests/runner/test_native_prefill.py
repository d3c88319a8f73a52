"""The AMX prefill-attention kernel (``quanta.runner.native_prefill``): it agrees with attention
computed in fp32 as closely as bf16 SDPA does, with sliding windows and soft-capped scores
too, reads only the chunk's own context, gives a row the same bits wherever its chunk starts
(so a cached prefix changes no logit), and is chosen only where it runs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from quanta.core.request import SamplingParams
from quanta.runner import native_prefill

CPU = torch.device("cpu")
KERNEL = native_prefill.load()
needs_amx = pytest.mark.skipif(KERNEL is None, reason="no AMX tiles (or no C compiler) here")


def _case(
    start: int,
    n: int,
    heads: int,
    kv_heads: int,
    dim: int,
    block_size: int,
    seed: int = 0,
    scale: float = 1.0,
    window: int = 0,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q [n, H, D] as a slice of a wider qkv row, the cache [2, slots, KVH, D], the chunk's
    block table in a shuffled order, fp32 attention over the same values: HF's eager
    sequence, soft-cap and window included)."""
    gen = torch.Generator().manual_seed(seed)
    context = start + n
    num_blocks = -(-context // block_size) + 3
    cache = (
        torch.randn(2, num_blocks * block_size, kv_heads, dim, generator=gen) * scale
    ).bfloat16()
    table = torch.randperm(num_blocks, generator=gen)[: -(-context // block_size)].contiguous()
    qkv = torch.randn(n, heads + 2 * kv_heads, dim, generator=gen).bfloat16()
    q = qkv[:, :heads]  # rows (heads + 2 kv_heads) * dim apart, as the fused projection gives
    slots = (table[:, None] * block_size + torch.arange(block_size)).flatten()[:context]
    keys, values = cache[0, slots].float(), cache[1, slots].float()
    want = _reference(q.float(), keys, values, start, window, softcap)
    return q, cache, table, want


def _mask(start: int, n: int, window: int) -> torch.Tensor:
    """[n, start + n]: which keys row i (position start + i) sees."""
    keys, rows = torch.arange(start + n)[None, :], torch.arange(start, start + n)[:, None]
    return (keys <= rows) & ((rows - keys < window) if window else True)


def _reference(q, keys, values, start: int, window: int, softcap: float | None):
    """Attention as HF's eager Gemma 2 computes it, in the inputs' dtype: q [n, H, D] over
    keys and values [L, KVH, D] -> [n, H, D]."""
    groups = q.shape[1] // keys.shape[1]
    keys = keys.repeat_interleave(groups, dim=1)
    values = values.repeat_interleave(groups, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q, keys) * q.shape[2] ** -0.5
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~_mask(start, q.shape[0], window), float("-inf"))
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.einsum("hnl,lhd->nhd", weights, values)


def _run(
    q: torch.Tensor,
    cache: torch.Tensor,
    table: torch.Tensor,
    block_size: int,
    start: int,
    window: int = 0,
    softcap: float | None = None,
):
    assert KERNEL is not None
    out = torch.empty(q.shape, dtype=q.dtype)
    scale = q.shape[2] ** -0.5
    KERNEL(out, q, cache[0], cache[1], table, block_size, start, scale, window, softcap)
    return out


@needs_amx
@pytest.mark.parametrize(
    ("start", "n", "heads", "kv_heads", "dim", "block_size"),
    [
        (0, 1, 4, 4, 64, 32),
        (0, 37, 9, 3, 64, 32),
        (100, 17, 9, 3, 64, 32),
        (460, 200, 9, 3, 64, 32),
        (1500, 40, 8, 2, 128, 16),
        (63, 66, 4, 1, 32, 16),
        (5, 300, 6, 2, 96, 48),
    ],
)
def test_native_prefill_is_as_close_to_fp32_as_bf16_sdpa(
    start, n, heads, kv_heads, dim, block_size
):
    q, cache, table, want = _case(start, n, heads, kv_heads, dim, block_size)
    got = _run(q, cache, table, block_size, start).float()
    slots = (table[:, None] * block_size + torch.arange(block_size)).flatten()[: start + n]
    sdpa = (
        F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            cache[0, slots].transpose(0, 1)[None],
            cache[1, slots].transpose(0, 1)[None],
            attn_mask=torch.arange(start + n)[None, :] <= torch.arange(start, start + n)[:, None],
            scale=dim**-0.5,
            enable_gqa=True,
        )[0]
        .transpose(0, 1)
        .float()
    )
    ours, theirs = (got - want).abs().max().item(), (sdpa - want).abs().max().item()
    # both round the probabilities and the output to bf16: within one more bf16 step
    assert ours <= 2 * theirs + 2**-9, (ours, theirs)


@needs_amx
@pytest.mark.parametrize(
    ("start", "n", "window", "softcap"),
    [
        (0, 37, 0, 50.0),
        (0, 200, 8, None),
        (0, 200, 64, 50.0),
        (100, 17, 30, 50.0),
        (460, 200, 100, None),
        (460, 200, 129, 30.0),
        (63, 66, 1, None),
        (1500, 40, 4096, 50.0),
    ],
)
def test_windows_and_soft_caps_are_as_close_to_fp32_as_bf16_eager(start, n, window, softcap):
    """Against HF's eager sequence in fp32, as close as that sequence in bf16 is (it rounds
    the scores to bf16 before the cap; the kernel caps fp32 sums)."""
    q, cache, table, want = _case(start, n, 6, 2, 64, 32, seed=4, window=window, softcap=softcap)
    got = _run(q, cache, table, 32, start, window, softcap).float()
    slots = (table[:, None] * 32 + torch.arange(32)).flatten()[: start + n]
    eager = _reference(q, cache[0, slots], cache[1, slots], start, window, softcap).float()
    ours, theirs = (got - want).abs().max().item(), (eager - want).abs().max().item()
    assert ours <= 2 * theirs + 2**-9, (ours, theirs)


@needs_amx
def test_a_soft_cap_bounds_the_scores():
    """Scores far past the cap: soft-capped they stay within it, so no key takes every
    weight (without the cap the peak would)."""
    q, cache, table, want = _case(50, 30, 2, 2, 32, 16, seed=3, scale=40.0, softcap=5.0)
    got = _run(q, cache, table, 16, 50, softcap=5.0).float()
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, atol=0.05, rtol=0.02)
    uncapped = _run(q, cache, table, 16, 50).float()
    assert (uncapped - got).abs().max() > 1.0


@needs_amx
@pytest.mark.parametrize("window", [1, 16, 64, 100])
@pytest.mark.parametrize("cut", [17, 64, 65, 300])
def test_a_windowed_rows_bits_do_not_depend_on_where_its_chunk_starts(window, cut):
    q, cache, table, _ = _case(0, 400, 4, 2, 64, 32, seed=5)
    whole = _run(q, cache, table, 32, 0, window, 50.0)
    rest = _run(q[cut:], cache, table, 32, cut, window, 50.0)
    assert torch.equal(rest, whole[cut:])


@needs_amx
def test_keys_outside_every_window_are_never_read():
    """Keys no row's window reaches may hold anything (a released block's next owner's
    values): the result does not change."""
    window, start, n = 40, 300, 50
    q, cache, table, _ = _case(start, n, 4, 2, 64, 32, seed=6)
    clean = _run(q, cache, table, 32, start, window)
    dirty = cache.clone()
    slots = (table[:, None] * 32 + torch.arange(32)).flatten()[: start - window + 1]
    # whole groups of 64 keys before the first row's window
    dirty[:, slots[: (start - window + 1) // 64 * 64]] = float("nan")
    assert torch.equal(_run(q, dirty, table, 32, start, window), clean)


@needs_amx
@pytest.mark.parametrize("cut", [1, 15, 16, 17, 63, 64, 65, 300, 599])
def test_a_rows_bits_do_not_depend_on_where_its_chunk_starts(cut):
    """A prompt prefilled whole, or its rest after a cached prefix of ``cut`` tokens, gives
    every row the same bits: keys past a row's position add exactly nothing."""
    q, cache, table, _ = _case(0, 600, 9, 3, 64, 32, seed=1)
    whole = _run(q, cache, table, 32, 0)
    rest = _run(q[cut:], cache, table, 32, cut)
    assert torch.equal(rest, whole[cut:])


@needs_amx
def test_stale_slots_are_never_read():
    """Slots past the context in its last block, and blocks outside the table, may hold
    anything an earlier owner left (NaN, inf): the result does not change."""
    q, cache, table, _ = _case(30, 45, 4, 2, 64, 32, seed=2)
    clean = _run(q, cache, table, 32, 30)
    dirty = torch.full_like(cache, float("nan"))
    slots = (table[:, None] * 32 + torch.arange(32)).flatten()[:75]
    dirty[:, slots] = cache[:, slots]
    dirty[0, slots[-1] + 1] = float("inf")
    assert torch.equal(_run(q, dirty, table, 32, 30), clean)


@needs_amx
def test_extreme_scores_give_the_softmax_of_the_peak():
    """Scores far beyond exp's range: every row's weight goes to its largest score."""
    q, cache, table, want = _case(50, 30, 2, 2, 32, 16, seed=3, scale=40.0)
    got = _run(q, cache, table, 16, 50).float()
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, atol=0.05, rtol=0.02)


@needs_amx
def test_the_kernel_refuses_layouts_it_cannot_read():
    assert KERNEL is not None
    q, cache, table, _ = _case(0, 8, 4, 2, 64, 32)
    out = torch.empty(q.shape, dtype=q.dtype)
    with pytest.raises(ValueError, match="unsupported layout or dtype"):
        KERNEL(out, q.float(), cache[0], cache[1], table, 32, 0, 0.1)
    with pytest.raises(ValueError, match="unsupported layout or dtype"):
        KERNEL(out, q, cache[0], cache[1], table.int(), 32, 0, 0.1)
    with pytest.raises(ValueError, match="unsupported layout or dtype"):
        KERNEL(out, q, cache[0], cache[1], table, 32, 0, 0.1, softcap=0.0)


def test_the_rule_picks_amx_only_where_it_runs(monkeypatch):
    def choose(**overrides):
        settings = {
            "dtype": torch.bfloat16,
            "device": CPU,
            "block_size": 32,
            "head_dim": 64,
            **overrides,
        }
        return native_prefill.choose(**settings)[1]

    expected = "amx" if KERNEL is not None else "sdpa"
    assert choose() == expected
    assert choose(dtype=torch.float32) == "sdpa"
    assert choose(block_size=8) == "sdpa"
    assert choose(head_dim=48) == "sdpa"
    assert choose(device=torch.device("meta")) == "sdpa"
    monkeypatch.setenv(native_prefill.PREFILL_KERNEL_ENV, "sdpa")
    assert choose() == "sdpa"
    monkeypatch.setenv(native_prefill.PREFILL_KERNEL_ENV, "fast")
    with pytest.raises(ValueError, match="use amx or sdpa"):
        choose()


@needs_amx
@pytest.mark.engine
def test_a_cached_prefix_changes_no_logprob_of_a_bf16_engine(tmp_path: Path):
    """The same prompt after a cached prefix and from token 0, on a bf16 LLaMA whose prefill
    chunks attend on AMX: the greedy tokens and their log-probabilities are equal, to the
    bit (the decode steps read K/V that the prefix's own prefill wrote)."""
    import quanta
    from quanta.build.checkpoint import make_checkpoint
    from quanta.build.presets import get_preset

    # llama-tiny with heads of 32 columns (its own have 16, which the kernel does not serve)
    tiny = get_preset("llama-tiny")
    shape = tiny.shape.model_copy(update={"hidden_size": 128, "head_dim": 32})
    preset = tiny.model_copy(update={"name": "llama-h32", "shape": shape})
    path = make_checkpoint(preset, tmp_path / "llama", seed=5)
    prefix = [(11 * j) % 400 + 4 for j in range(96)]
    prompt = prefix + [(5 * j) % 300 + 7 for j in range(40)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3)
    plain = quanta.LLM(str(path), dtype="bfloat16", enable_prefix_caching=False)
    cached = quanta.LLM(str(path), dtype="bfloat16")
    assert cached.engine.runner.prefill_attention == "amx"
    cached.generate([prefix], SamplingParams(max_tokens=1))
    got = cached.generate([prompt], params)[0]
    want = plain.generate([prompt], params)[0]
    assert cached.engine.loop.stats().prefix_cache_hits >= 96
    assert got.token_ids == want.token_ids
    assert got.logprobs == want.logprobs and len(got.logprobs) == 6


def test_bench_shapes_parse_and_each_variant_gets_its_own_ids():
    from quanta_lab.bench.prefix_prefill import parse_shapes, token_pairs

    assert parse_shapes("460:335, 0:8") == [(460, 335), (0, 8)]
    for bad in ("460", "5:0", "a:3", "3:-1"):
        with pytest.raises(ValueError, match="PREFIX:NEW"):
            parse_shapes(bad)
    pairs = token_pairs([(40, 5), (0, 3)], repeats=2, variants=2, vocab=500)
    prefixes = [tuple(p) for lists in pairs["40:5"] for p, _ in lists]
    assert len(set(prefixes)) == 4 and all(len(p) == 40 for p in prefixes)
    assert all(100 <= t < 499 for lists in pairs["0:3"] for _, new in lists for t in new)


@pytest.mark.engine
def test_bench_prefix_prefill_times_each_path(tmp_path: Path):
    from quanta.build.checkpoint import make_checkpoint
    from quanta.build.presets import get_preset
    from quanta_lab.bench.prefix_prefill import run_prefix_prefill

    tiny = get_preset("llama-tiny")
    shape = tiny.shape.model_copy(update={"hidden_size": 128, "head_dim": 32})
    preset = tiny.model_copy(update={"name": "llama-h32", "shape": shape})
    path = make_checkpoint(preset, tmp_path / "llama", seed=5)
    rows, meta = run_prefix_prefill(path, "bfloat16", [(64, 16), (0, 20)], repeats=2)
    assert [(r.prefix, r.new) for r in rows] == [(64, 16), (0, 20)]
    assert all(r.sdpa_ms > 0 and r.vllm_ms is None for r in rows)
    assert meta["prefill_attention"] == ("amx" if KERNEL is not None else "sdpa")
    assert all((r.amx_ms is not None) == (KERNEL is not None) for r in rows)
