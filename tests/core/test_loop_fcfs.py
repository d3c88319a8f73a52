"""The loop and FCFS on a fake runner: batching, chunking, preemption, errors, cancellation."""

from __future__ import annotations

import threading

import pytest
from conftest import make_requests
from quanta.core.errors import (
    CapacityError,
    EmptyPromptError,
    PromptTooLongError,
    RequestAbortedError,
)
from quanta.core.request import Request, SamplingParams


def run_all(loop, requests):
    streams = [loop.submit(r) for r in requests]
    loop.run_until_idle()
    return {r.request_id: s.result(timeout=0) for r, s in zip(requests, streams, strict=True)}


def reference(make_loop, requests, **kw):
    """Outputs with a pool so large nothing is ever preempted."""
    loop = make_loop(device=512, host=0, max_num_batched_tokens=4096, **kw)
    return run_all(loop, requests)


@pytest.mark.parametrize("chunked", [True, False])
def test_all_requests_complete_with_their_lengths(make_loop, chunked):
    reqs = make_requests(5, prompt_len=[3, 9, 17, 4, 30], max_tokens=7)
    loop = make_loop(
        max_num_batched_tokens=256 if not chunked else 8, enable_chunked_prefill=chunked
    )
    out = run_all(loop, reqs)
    for r in reqs:
        assert out[r.request_id].finish_reason == "length"
        assert len(out[r.request_id].token_ids) == 7
        assert out[r.request_id].error is None


def test_chunked_prefill_respects_budget_and_mixes_decodes(make_loop):
    reqs = make_requests(3, prompt_len=[20, 3, 3], max_tokens=5)
    loop = make_loop(max_num_batched_tokens=6)
    run_all(loop, reqs)
    steps = loop.runner.steps
    assert all(s.num_tokens <= 6 for s in steps)
    mixed = [
        s
        for s in steps
        if any(q.num_new_tokens > 1 for q in s.seqs) and any(q.num_new_tokens == 1 for q in s.seqs)
    ]
    assert mixed, "a prefill chunk never shared a step with decodes"


@pytest.mark.parametrize("host", [64, 0], ids=["swap", "recompute"])
def test_preemption_preserves_outputs(make_loop, host):
    reqs = make_requests(6, prompt_len=[5, 8, 6, 9, 7, 4], max_tokens=20, temperature=0.8)
    expected = reference(
        make_loop, make_requests(6, prompt_len=[5, 8, 6, 9, 7, 4], max_tokens=20, temperature=0.8)
    )
    loop = make_loop(device=12, host=host, max_num_batched_tokens=16)
    got = run_all(loop, reqs)
    stats = loop.stats()
    if host:
        assert stats.num_preemptions_swap > 0
        assert stats.num_preemptions_recompute == 0
    else:
        assert stats.num_preemptions_recompute > 0
        assert stats.num_preemptions_swap == 0
    assert sum(r.num_preemptions for r in reqs) > 0
    for rid, res in expected.items():
        assert got[rid].token_ids == res.token_ids
        assert got[rid].text == res.text


def test_swap_falls_back_to_recompute_when_host_is_small(make_loop):
    spec = dict(prompt_len=[8, 8, 8, 8], max_tokens=24)
    expected = reference(make_loop, make_requests(4, **spec))
    loop = make_loop(device=14, host=3, max_num_batched_tokens=32)
    got = run_all(loop, make_requests(4, **spec))
    s = loop.stats()
    assert s.num_preemptions_recompute > 0 and s.num_preemptions_swap > 0
    assert {k: v.token_ids for k, v in got.items()} == {k: v.token_ids for k, v in expected.items()}


def test_typed_errors_on_submit(make_loop):
    loop = make_loop(device=6, max_model_len=32)
    good = make_requests(1)[0]
    base = dict(params=SamplingParams(max_tokens=4), arrival_time=0.0, seed=1)
    with pytest.raises(EmptyPromptError):
        loop.submit(Request("e", [], **base))
    with pytest.raises(PromptTooLongError, match="exceeds the model's maximum length of 32"):
        loop.submit(Request("l", [1] * 30, **base))
    with pytest.raises(CapacityError, match="could never complete"):
        loop.submit(
            Request("c", [1] * 20, params=SamplingParams(max_tokens=12), arrival_time=0.0, seed=1)
        )
    assert run_all(loop, [good])["r0"].finish_reason == "length"


def test_stop_string_is_never_emitted(make_loop):
    [probe] = make_requests(1, max_tokens=30)
    text = run_all(make_loop(), [probe])["r0"].text
    stop = text[10:13]
    [req] = make_requests(1, max_tokens=30, stop=[stop, "never-there"])
    loop = make_loop()
    stream = loop.submit(req)
    loop.run_until_idle()
    deltas = list(stream)
    full = "".join(d.new_text for d in deltas)
    assert full == text[: text.index(stop)]
    assert deltas[-1].finish_reason == "stop"
    assert all(stop not in "".join(d.new_text for d in deltas[: i + 1]) for i in range(len(deltas)))


def test_eos_and_stop_token_ids(make_loop):
    [probe] = make_requests(1, max_tokens=12)
    ids = run_all(make_loop(), [probe])["r0"].token_ids
    [req] = make_requests(1, max_tokens=12, stop_token_ids=[ids[4]])
    got = run_all(make_loop(), [req])["r0"]
    assert got.token_ids == ids[: ids.index(ids[4]) + 1]
    assert got.finish_reason == "stop"
    [req] = make_requests(1, max_tokens=12)
    req.eos_token_ids = (ids[3],)
    assert run_all(make_loop(), [req])["r0"].token_ids == ids[: ids.index(ids[3]) + 1]
    [req] = make_requests(1, max_tokens=12, ignore_eos=True)
    req.eos_token_ids = (ids[3],)
    assert run_all(make_loop(), [req])["r0"].token_ids == ids


def test_cancel_frees_blocks_and_others_continue(make_loop):
    loop = make_loop()
    reqs = make_requests(3, max_tokens=50)
    streams = [loop.submit(r) for r in reqs]
    for _ in range(3):
        loop.step()
    loop.cancel("r1")
    loop.run_until_idle()
    cancelled = streams[1].result(timeout=0)
    assert cancelled.finish_reason == "abort"
    assert isinstance(cancelled.error, RequestAbortedError)
    assert streams[0].result(timeout=0).finish_reason == "length"
    assert streams[2].result(timeout=0).finish_reason == "length"


def test_failed_step_fails_only_its_requests(make_loop):
    loop = make_loop(fail_on={"r1"}, max_num_seqs=1)
    out = run_all(loop, make_requests(3, max_tokens=4))
    assert out["r1"].finish_reason == "error"
    assert "injected failure" in str(out["r1"].error)
    assert out["r0"].finish_reason == "length" and out["r2"].finish_reason == "length"


def test_threaded_loop_serves_concurrent_clients(make_loop):
    loop = make_loop()
    loop.start()
    reqs = make_requests(8, max_tokens=10)
    results = {}

    def client(r):
        results[r.request_id] = loop.submit(r).result(timeout=30)

    threads = [threading.Thread(target=client, args=(r,)) for r in reqs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(len(res.token_ids) == 10 for res in results.values())


def test_stop_fails_in_flight_requests(make_loop):
    loop = make_loop()
    [r] = make_requests(1, max_tokens=100)
    stream = loop.submit(r)
    loop.step()
    loop.stop("shutting down for test")
    res = stream.result(timeout=1)
    assert res.finish_reason == "abort"
    assert "shutting down for test" in str(res.error)
