"""Embedding requests in the core: which rows each chunk asks the runner to pool, that a
pooling request ends when its prompt is computed, with no token, and the pooling maths."""

from __future__ import annotations

import math

import pytest
from conftest import make_requests
from pydantic import ValidationError
from quanta.core.pooling import PoolingParams, pooled_vector


def _asks(make_loop, pooling_type: str, prompt_len: int, **sched: object):
    """Run one pooling request on the fake runner, recording its seqs' asks."""
    loop = make_loop(**sched)
    seen = []
    execute = loop.runner.execute

    def record(so):
        seen.extend(s for s in so.seqs)
        return execute(so)

    loop.runner.execute = record
    (r,) = make_requests(1, prompt_len=prompt_len, max_tokens=1)
    r.pooling = PoolingParams(pooling_type=pooling_type)
    stream = loop.submit(r)
    loop.run_until_idle()
    return r, seen, stream.result(timeout=0)


@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN"])
def test_a_chunked_pooling_request_asks_each_row_once_and_never_samples(make_loop, pooling_type):
    r, seqs, done = _asks(
        make_loop, pooling_type, 10, enable_chunked_prefill=True, max_num_batched_tokens=4
    )
    assert [s.num_new_tokens for s in seqs] == [4, 4, 2]
    assert not any(s.sample for s in seqs)
    asks = [(s.pooling.first, s.pooling.num_rows) if s.pooling else None for s in seqs]
    if pooling_type == "LAST":
        assert asks == [None, None, (9, 1)]
    else:
        assert asks == [(0, 4), (4, 4), (8, 2)]
    assert done.error is None and done.finish_reason == "stop"
    assert done.token_ids == () and r.num_output_tokens == 0


def test_pooled_vector_means_and_normalizes():
    assert pooled_vector([2.0, 4.0], 2, PoolingParams(normalize=False)) == (1.0, 2.0)
    unit = pooled_vector([3.0, 4.0], 1, PoolingParams())
    assert math.isclose(unit[0], 0.6) and math.isclose(unit[1], 0.8)
    assert pooled_vector([0.0, 0.0], 1, PoolingParams()) == (0.0, 0.0)
    assert PoolingParams(pooling_type="mean").pooling_type == "MEAN"
    with pytest.raises(ValidationError):
        PoolingParams(pooling_type="CLS")
