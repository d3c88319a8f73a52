"""Prompt logprobs with the prefix cache on a real engine and through the OpenAI gateway, and
a served engine under injected faults: one request's fault ends only it, a stalled loop
turns health and readiness to 503 with the reason, and an uncontainable fault ends every
request in flight and the tritonserver, which ``quanta serve`` restarts."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request

import openai
import pytest
from quanta.core.request import SamplingParams
from serving import scrape, start_serve, stop_serve, wait_for


def lm_eval_prompts() -> list[list[int]]:
    """Contexts longer than a block (16), each with several continuations: what
    lm-evaluation-harness's loglikelihood requests look like."""
    contexts = [[(7 * j + 3 * c) % 200 + 4 for j in range(19 + 9 * c)] for c in range(3)]
    return [
        ctx + [(11 * k + j) % 150 + 5 for j in range(2 + k)] for ctx in contexts for k in range(4)
    ]


@pytest.mark.engine
@pytest.mark.parametrize("chunked", [False, True])
def test_real_engine_prompt_logprobs_with_the_cache_equal_those_without(opt_tiny, chunked):
    """Every prompt logprob of requests sharing cached prefixes, through a pool small enough
    to preempt, equals the run without the cache (the cached rows are computed, not lost)."""
    import quanta

    prompts = lm_eval_prompts()
    params = SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=1, ignore_eos=True)
    plain = quanta.LLM(str(opt_tiny), enable_prefix_caching=False).generate(prompts, params)
    cached = quanta.LLM(
        str(opt_tiny),
        cache={"block_size": 16, "num_device_blocks": 8, "num_host_blocks": 0},
        scheduler={"max_num_seqs": 4, "max_num_batched_tokens": 24 if chunked else 256},
    )
    cached.generate(prompts[:1], params)  # NOTE: later prompts find its prefix cached
    got = cached.generate(prompts, params)
    for prompt, want, have in zip(prompts, plain, got, strict=True):
        assert have.error is None, have.error
        assert len(have.prompt_logprobs) == len(prompt) - 1
        assert have.token_ids == want.token_ids
        for a, b in zip(have.prompt_logprobs, want.prompt_logprobs, strict=True):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-3)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
    stats = cached.engine.loop.stats()
    assert stats.num_preemptions_recompute > 0
    cached.engine.loop.blocks.check_integrity()
    assert cached.engine.loop.blocks.all_free()


# -- through the gateway -------------------------------------------------------------------
def _get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


@pytest.mark.live
def test_echo_logprobs_of_prompts_sharing_a_cached_block_answer_and_the_engine_goes_on(triton):
    """The report's case: two echo + logprobs completions whose prompts share a 19-token
    prefix (a full 16-token block cached), then a plain request."""
    url = triton.openai_url("quanta", "tiny")
    common = [(13 * j) % 400 + 4 for j in range(19)]
    with openai.OpenAI(base_url=url, api_key="-", max_retries=0, timeout=60) as c:
        first = c.completions.create(
            model="tiny", prompt=[*common, 5, 6, 7], max_tokens=1, echo=True, logprobs=1
        )
        again = c.completions.create(
            model="tiny", prompt=[*common, 9, 10], max_tokens=1, echo=True, logprobs=1
        )
        for answer, n in ((first, 22), (again, 21)):
            lps = answer.choices[0].logprobs.token_logprobs
            assert len(lps) == n + 1 and lps[0] is None and all(v is not None for v in lps[1:])
        # NOTE: the shared rows were computed for both: the same numbers
        assert first.choices[0].logprobs.token_logprobs[1:19] == pytest.approx(
            again.choices[0].logprobs.token_logprobs[1:19], abs=1e-4
        )
        plain = c.completions.create(model="tiny", prompt="Hello there", max_tokens=3)
        assert plain.choices[0].text is not None
    assert _get(url.removesuffix("/v1") + "/health")[0] == 200


# -- faults on a server of its own ---------------------------------------------------------
FAULTS = {
    "fault_injection": "commit:4242,runner:4243,apply:4244,stall:777,step:778",
    "stall_timeout_s": "3",
    "unhealthy_exit_s": "15",
}


def _complete(url: str, seed: int, out: dict[int, object], max_tokens: int = 4) -> None:
    with openai.OpenAI(base_url=url, api_key="-", max_retries=0, timeout=120) as c:
        try:
            out[seed] = c.completions.create(
                model="quanta", prompt="Hello there", max_tokens=max_tokens, seed=seed
            )
        except openai.APIError as exc:
            out[seed] = exc


@pytest.mark.live
@pytest.mark.slow
def test_faults_are_contained_or_end_the_server_which_is_restarted(tmp_path, opt_tiny):
    serve = start_serve(tmp_path, FAULTS, model_dir=opt_tiny)
    try:
        url = serve.openai_url
        health = url.removesuffix("/v1") + "/health"
        # one request's fault ends only it; the others around it complete
        out: dict[int, object] = {}
        threads = [
            threading.Thread(target=_complete, args=(url, seed, out, 12))
            for seed in (1, 4242, 2, 4243, 3, 4244, 4)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for seed in (4242, 4243, 4244):
            assert isinstance(out[seed], openai.InternalServerError), out[seed]
            assert "injected fault" in str(out[seed])
        for seed in (1, 2, 3, 4):
            assert not isinstance(out[seed], Exception), out[seed]
        assert _get(health)[0] == 200
        assert scrape(serve.metrics_url)["quanta_engine_healthy"] == 1.0

        # a stalled loop: health fails with the reason, the metric reads 0, requests end
        stalled: dict[int, object] = {}
        waiting = threading.Thread(target=_complete, args=(url, 777, stalled))
        waiting.start()
        _, body = wait_for(
            lambda: (r := _get(health))[0] == 503 and r, timeout=60, what="/health to fail"
        )
        assert "no engine step completed" in body["error"]["message"]
        # NOTE: the metrics are flushed every metrics_interval_ms, /health asks at once
        metrics = wait_for(
            lambda: (m := scrape(serve.metrics_url))["quanta_engine_healthy"] == 0.0 and m,
            timeout=10,
            what="quanta_engine_healthy to read 0",
        )
        assert metrics["quanta_engine_seconds_since_step"] >= 3
        waiting.join(60)
        assert isinstance(stalled[777], openai.APIStatusError) and stalled[777].status_code == 503
        assert "no engine step completed" in str(stalled[777])
        # then tritonserver is ended, and quanta serve restarts it
        assert serve.output.wait_for("ready again after restart 1", 180) is not None
        assert _get(health)[0] == 200

        # an uncontainable fault: every request in flight ends, then a restart again
        dead: dict[int, object] = {}
        threads = [threading.Thread(target=_complete, args=(url, s, dead, 200)) for s in (5, 778)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        for seed in (5, 778):
            assert isinstance(dead[seed], openai.APIStatusError), dead[seed]
            assert "injected fault at step" in str(dead[seed])
        assert serve.output.wait_for("ready again after restart 2", 180) is not None
        out.clear()
        _complete(url, 6, out)
        assert not isinstance(out[6], Exception), out[6]
    finally:
        code, text = stop_serve(serve)
    log = (tmp_path / "tritonserver.log").read_text(errors="replace")
    assert "the engine is unhealthy: no engine step completed" in log
    assert "the engine is unhealthy: the engine loop died" in log
    assert code == 0, text
