"""The fp32 few-rows kernel (``quanta.runner.fp32_rows``): it computes ``F.linear`` (to fp32
rounding) for every row count it serves, in both of its forms and ragged shapes included, a
row's bits do not depend on the rows beside it within a form, and fp32 projections of up to
64 rows run through it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from quanta.runner import fp32_rows
from quanta.runner.linear import PackedLinear

KERNEL = fp32_rows.load()
needs_kernel = pytest.mark.skipif(KERNEL is None, reason="no AVX-512 (or no C compiler) here")


def _close(got: torch.Tensor, want: torch.Tensor, k: int) -> None:
    # sums of k products in another order: a few ulps of the sum of magnitudes
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * k**0.5)


@needs_kernel
@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 64),
    n=st.integers(1, 70),
    k=st.integers(1, 300),
    bias=st.booleans(),
    relu=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_the_product_is_f_linear_for_every_shape(rows, n, k, bias, relu, seed):
    """Weight rows past a multiple of the block (three in the dot form, 6-12 in the broadcast
    form), rows past a multiple of 16 and K past a multiple of 16 take the kernel's tails."""
    assert KERNEL is not None
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen)
    w = torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    want = F.linear(x, w, b)
    _close(KERNEL.product(x, w, b, relu), want.relu() if relu else want, k)


@needs_kernel
@pytest.mark.parametrize(("n", "k"), [(4096, 768), (768, 2048), (1000, 2051)])
def test_a_rows_bits_do_not_depend_on_the_rows_beside_it(n, k):
    """Within each form: up to ``dot_rows`` rows (sums across lanes), and from there to
    ``max_rows`` (K's order; 9 rows fill one vector of 16, 64 fill four)."""
    assert KERNEL is not None
    dot = KERNEL.dot_rows
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(KERNEL.max_rows, k, generator=gen), torch.randn(n, k, generator=gen)
    together = KERNEL.product(x[:dot], w, None, False)
    for r in range(dot):
        assert torch.equal(KERNEL.product(x[r : r + 1], w, None, False), together[r : r + 1])
    assert torch.equal(KERNEL.product(x[2:5], w, None, False), together[2:5])
    wide = KERNEL.product(x, w, None, False)
    for lo, hi in ((0, dot + 1), (5, 21), (13, 46), (20, KERNEL.max_rows)):
        assert torch.equal(KERNEL.product(x[lo:hi], w, None, False), wide[lo:hi]), (lo, hi)


@needs_kernel
@pytest.mark.parametrize("rows", [5, 40])
def test_threads_split_the_weight_rows_without_changing_a_bit(rows):
    """Both forms hand whole blocks of weight rows to each OpenMP thread (the tail rows after
    the last block stay on the calling thread)."""
    assert KERNEL is not None
    gen = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, 300, generator=gen), torch.randn(1001, 300, generator=gen)
    b = torch.randn(1001, generator=gen)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = KERNEL.product(x, w, b, True)
        torch.set_num_threads(2)
        two = KERNEL.product(x, w, b, True)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)
    _close(one, F.linear(x, w, b).relu(), 300)


@needs_kernel
def test_the_kernel_refuses_what_it_cannot_read():
    assert KERNEL is not None
    w = torch.randn(16, 32)
    with pytest.raises(ValueError, match="unsupported"):
        KERNEL.product(torch.randn(KERNEL.max_rows + 1, 32), w, None, False)
    with pytest.raises(ValueError, match="unsupported"):
        KERNEL.product(torch.randn(2, 32).bfloat16(), w.bfloat16(), None, False)
    with pytest.raises(ValueError, match="unsupported"):
        KERNEL.product(torch.randn(2, 32), w.t(), None, False)  # not [N, K] contiguous


@pytest.mark.parametrize("activation", ["none", "relu"])
def test_fp32_projections_of_a_few_rows_take_the_kernel(monkeypatch, activation):
    """Up to 64 rows through the kernel (where it runs), more through oneDNN; both equal
    ``F.linear``, the residual add included."""
    w, b = torch.randn(40, 24), torch.randn(40)
    projection = PackedLinear(w, b, activation)
    calls: list[int] = []
    if KERNEL is not None:
        product = KERNEL.product
        monkeypatch.setattr(KERNEL, "product", lambda x, *a: calls.append(len(x)) or product(x, *a))
    for rows in (1, 3, 8, 9, 40, 64, 65, 100):
        x = torch.randn(rows, 24)
        want = F.linear(x, w, b)
        want = want.relu() if activation == "relu" else want
        _close(projection(x), want, 24)
        if activation == "none":
            residual = torch.randn(rows, 40)
            _close(projection.add(x, residual), want + residual, 24)
    x = torch.randn(2, 5, 24)  # rows of a [batch, tokens, features] input: ten
    _close(
        projection(x), F.linear(x, w, b).relu() if activation == "relu" else F.linear(x, w, b), 24
    )
    if KERNEL is not None:
        assert sorted(set(calls)) == [1, 3, 8, 9, 10, 40, 64]


def test_the_kernel_can_be_set_aside(monkeypatch):
    """``QUANTA_FP32_ROWS=off``: fp32 projections of a few rows run MKL and oneDNN again (the
    same bits as ``F.linear`` up to three rows); a misspelt setting is refused, not ignored."""
    monkeypatch.setenv(fp32_rows.FP32_ROWS_ENV, "off")
    assert fp32_rows.load() is None
    w, x = torch.randn(40, 24), torch.randn(2, 24)
    assert torch.equal(PackedLinear(w, None, "none")(x), F.linear(x, w))
    monkeypatch.setenv(fp32_rows.FP32_ROWS_ENV, "of")
    with pytest.raises(ValueError, match="QUANTA_FP32_ROWS"):
        fp32_rows.load()
    monkeypatch.setenv(fp32_rows.FP32_ROWS_ENV, "on")
    assert fp32_rows.load() is KERNEL
