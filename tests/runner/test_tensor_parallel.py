"""Tensor parallelism (``quanta.runner.tensor_parallel``): two ranks on gloo compute what one
process computes, for OPT (multi-head, tied head), LLaMA (multi-head and grouped-query,
untied head) and the layer kit's Qwen2, Qwen3, Mistral, Phi-3 and Gemma 2; preempted, swapped and
recomputed requests come out unchanged; a step of preemptible work stops on every rank at
once; a rank that dies fails its requests with a clear error, never a hang, and the next
request gets fresh workers."""

from __future__ import annotations

import os
import signal
import threading
import time
import urllib.request
from dataclasses import replace
from pathlib import Path

import pytest
import quanta
import torch
from preemption import roomy_and_cramped
from quanta.core.config import EngineConfig
from quanta.core.errors import WorkerLostError
from quanta.core.output import ScheduledSeq, SchedulerOutput
from quanta.core.safepoint import AbortSignal, StepAborted
from quanta.runner.model_runner import ModelRunner
from quanta.runner.models.config import load_model_config
from quanta.runner.tensor_parallel import check_tensor_parallel

pytestmark = pytest.mark.engine

PROMPTS = [f"tell me about number {i} " * (1 + i % 3) for i in range(5)]
GREEDY = quanta.SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
SEEDED = quanta.SamplingParams(max_tokens=20, temperature=0.9, top_p=0.9, seed=11, ignore_eos=True)


@pytest.fixture(scope="module", params=["opt-tiny", "llama-tiny", "llama-tiny-mha"])
def model_dir(request, tiny_checkpoint) -> Path:
    return tiny_checkpoint(request.param)


def _runner(model_dir: Path, tp: int = 1, **kw: object) -> ModelRunner:
    return ModelRunner(
        model_dir,
        num_device_blocks=16,
        num_host_blocks=8,
        dtype="float32",
        tensor_parallel_size=tp,
        **kw,  # type: ignore[arg-type]
    )


def test_two_ranks_give_the_logits_of_one(model_dir):
    ids = [(7 * j + 3) % 500 for j in range(45)]
    expected = _runner(model_dir).forward_logits(ids, chunk_size=16)
    tp = _runner(model_dir, tp=2)
    try:
        got = tp.forward_logits(ids, chunk_size=16)
        assert tp.kv_config.num_heads * 2 == tp.model_config.num_heads
        assert tp.device_kv_cache.shape[-2] * 2 == tp.model_config.num_kv_heads
    finally:
        tp.close()
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


def test_generation_with_two_ranks_equals_one_greedy_and_seeded(model_dir):
    params = [GREEDY] * len(PROMPTS) + [SEEDED] * 2
    prompts = PROMPTS + PROMPTS[:2]
    expected = quanta.LLM(str(model_dir), dtype="float32").generate(prompts, params)
    with quanta.LLM(str(model_dir), dtype="float32", tensor_parallel_size=2) as llm:
        got = llm.generate(prompts, params)
        assert llm.engine.describe()["tensor_parallel_size"] == "2"
    assert [g.token_ids for g in got] == [e.token_ids for e in expected]


@pytest.fixture(
    scope="module",
    params=["qwen2-tiny", "qwen3-tiny", "mistral-tiny", "phi3-tiny", "gemma2-tiny"],
)
def kit_model_dir(request, tiny_checkpoint, tmp_path_factory) -> Path:
    """A layer-kit preset; Mistral's and Gemma 2's with an 8-token window (the presets' is
    4096), so Mistral's every layer and Gemma 2's alternating local layers cut what prompts
    and generations outgrow."""
    import json
    import shutil

    preset = tiny_checkpoint(request.param)
    if request.param not in ("mistral-tiny", "gemma2-tiny"):
        return preset
    model_dir = shutil.copytree(preset, tmp_path_factory.mktemp(request.param) / "windowed")
    config_file = model_dir / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "sliding_window": 8}))
    return model_dir


def test_kit_families_with_two_ranks_give_the_logits_and_tokens_of_one(kit_model_dir):
    """The layer kit's own splits: Qwen2's q/k/v biases, Qwen3's per-head q/k norms,
    Mistral's window in every layer, Phi-3's fused qkv and gate_up cut per segment, Gemma 2's
    soft-capping, sandwich norms and alternating windows."""
    ids = [(7 * j + 3) % 500 for j in range(45)]
    expected_logits = _runner(kit_model_dir).forward_logits(ids, chunk_size=16)
    tp = _runner(kit_model_dir, tp=2)
    try:
        got_logits = tp.forward_logits(ids, chunk_size=16)
    finally:
        tp.close()
    torch.testing.assert_close(got_logits, expected_logits, rtol=1e-4, atol=1e-4)
    expected = quanta.LLM(str(kit_model_dir), dtype="float32").generate(PROMPTS, GREEDY)
    with quanta.LLM(str(kit_model_dir), dtype="float32", tensor_parallel_size=2) as llm:
        got = llm.generate(PROMPTS, GREEDY)
        assert llm.engine.runner.tp is not None and llm.engine.runner.tp.world == 2
    assert [g.token_ids for g in got] == [e.token_ids for e in expected]


@pytest.mark.parametrize("host_blocks", [0, 24], ids=["recompute", "swap"])
def test_preempted_requests_under_two_ranks_are_unchanged(llama_tiny, host_blocks):
    params = [GREEDY] * len(PROMPTS) + [SEEDED] * 2
    prompts = PROMPTS + PROMPTS[:2]
    expected, got = roomy_and_cramped(
        llama_tiny,
        prompts,
        params,
        host_blocks=host_blocks,
        device_blocks=20,
        tensor_parallel_size=2,
    )
    assert [g.token_ids for g in got] == [e.token_ids for e in expected]


def _prefill(tokens: list[int], abort: AbortSignal | None = None) -> SchedulerOutput:
    seq = ScheduledSeq(
        request_id="r0",
        token_ids=tuple(tokens),
        start_pos=0,
        block_table=(3, 1, 4, 0),
        sample=True,
        temperature=0.0,
        top_p=1.0,
        top_k=0,
        seed=1,
        output_index=0,
    )
    return SchedulerOutput(seqs=(seq,), abort=abort)


def test_a_raised_signal_stops_every_rank_and_the_step_runs_again(llama_tiny):
    tokens = [(5 * j + 3) % 400 + 4 for j in range(30)]
    expected = _runner(llama_tiny).execute(_prefill(tokens)).sampled_token_ids
    raised = AbortSignal()
    raised.raise_at(0.0)
    tp = _runner(llama_tiny, tp=2, safepoint_interval=1)
    try:
        with pytest.raises(StepAborted):
            tp.execute(_prefill(tokens, abort=raised))
        # the workers stopped at the same check: the group is whole and the step runs again
        again = tp.execute(_prefill(tokens, abort=AbortSignal()))
        assert tp.tp is not None and tp.tp.restarts == 0
    finally:
        tp.close()
    assert again.sampled_token_ids == expected


def test_a_killed_rank_fails_the_requests_then_fresh_workers_serve(llama_tiny):
    long = quanta.SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    with quanta.LLM(str(llama_tiny), dtype="float32", tensor_parallel_size=2) as llm:
        group = llm.engine.runner.tp
        assert group is not None
        results: list = []
        thread = threading.Thread(target=lambda: results.extend(llm.generate(PROMPTS, long)))
        started = time.monotonic()
        thread.start()
        while llm.engine.loop.stats().num_steps < 5 and time.monotonic() - started < 60:
            time.sleep(0.01)
        os.kill(group._procs[0].pid, signal.SIGKILL)
        thread.join(timeout=60)
        assert not thread.is_alive(), "generation hung after a rank died"
        assert len(results) == len(PROMPTS)
        assert all(r.finish_reason == "error" for r in results), results
        assert all(isinstance(r.error, WorkerLostError) for r in results)
        assert "rank 1 exited" in str(results[0].error)
        loop = llm.engine.loop
        loop.blocks.check_integrity()
        assert loop.blocks.all_free()
        again = llm.generate(PROMPTS[:2], GREEDY)
        assert group.restarts == 1
    expected = quanta.LLM(str(llama_tiny), dtype="float32").generate(PROMPTS[:2], GREEDY)
    assert [a.token_ids for a in again] == [e.token_ids for e in expected]


def test_splits_that_cannot_run_are_refused_by_name(llama_tiny):
    config = load_model_config(llama_tiny)  # 4 query heads, 2 KV heads
    with pytest.raises(ValueError, match="num_key_value_heads"):
        check_tensor_parallel(config, 4, torch.device("cpu"), None)
    with pytest.raises(ValueError, match="num_attention_heads"):
        check_tensor_parallel(
            replace(
                config, shape=config.shape.model_copy(update={"num_kv_heads": 3, "num_heads": 3})
            ),
            2,
            torch.device("cpu"),
            None,
        )
    with pytest.raises(ValueError, match="NCCL"):
        check_tensor_parallel(config, 2, torch.device("cuda"), None)
    with pytest.raises(ValueError, match="draft model"):
        check_tensor_parallel(config, 2, torch.device("cpu"), llama_tiny)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(model=str(llama_tiny), tensor_parallel_size=0)
    with pytest.raises(ValueError, match="num_key_value_heads"):
        quanta.LLM(str(llama_tiny), tensor_parallel_size=4)


@pytest.mark.live
def test_quanta_serve_with_two_ranks_answers_as_one(llama_tiny, tmp_path):
    """Through the real Triton server: the workers start from inside its Python stub."""
    import shlex
    import sys

    from quanta.frontends.triton.client import http_events, output_ids, request_inputs
    from quanta.frontends.triton.launcher import free_port
    from serving import Background

    ports = {name: free_port() for name in ("http", "grpc", "metrics")}
    cmd = [sys.executable, "-m", "quanta.cli", "serve", str(llama_tiny), "--dtype", "float32"]
    cmd += ["--tensor-parallel-size", "2"]
    cmd += [arg for name, port in ports.items() for arg in (f"--{name}-port", str(port))]
    srv = Background(shlex.join(cmd), tmp_path, {**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        srv.wait_for_line("ready", timeout=180)
        url = f"http://127.0.0.1:{ports['http']}"
        events = http_events(
            url, "quanta", request_inputs(PROMPTS[1], GREEDY, stream=False), stream=False
        )
        served = [t for e in events for t in output_ids(e)]
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{ports['metrics']}/metrics").read()
    finally:
        assert srv.stop() == 0, "".join(srv.lines)
    expected = quanta.LLM(str(llama_tiny), dtype="float32").generate([PROMPTS[1]], GREEDY)
    assert served == expected[0].token_ids
    assert b'tensor_parallel_size="2"' in metrics


def test_an_engine_built_with_tp_size_serves_on_that_many_ranks(llama_tiny, tmp_path):
    from quanta.build.engine_build import BuildOptions, build_engine_dir
    from quanta.build.manifest import read_manifest
    from quanta.frontends.engine import engine_config_for

    options = BuildOptions(tensor_parallel_size=2, kv_cache_memory=1 << 20, dtype="float32")
    engine = tmp_path / "engine"
    manifest = build_engine_dir(llama_tiny, engine, options)
    assert manifest.tensor_parallel_size == 2
    assert read_manifest(engine).tensor_parallel_size == 2
    one = build_engine_dir(
        llama_tiny, tmp_path / "one", options.model_copy(update={"tensor_parallel_size": 1})
    )
    # the same memory per rank holds twice the blocks: each rank keeps half of every block
    assert manifest.cache.num_device_blocks == 2 * one.cache.num_device_blocks
    config = load_model_config(engine)
    assert engine_config_for(EngineConfig(model=str(engine)), config).tensor_parallel_size == 2
    asked = engine_config_for(EngineConfig(model=str(engine), tensor_parallel_size=1), config)
    assert asked.tensor_parallel_size == 1 and asked.cache.num_device_blocks is None
    with quanta.LLM(str(engine)) as llm:
        assert llm.engine.runner.tp is not None and llm.engine.runner.tp.world == 2
        got = llm.generate(PROMPTS[:2], GREEDY)
    expected = quanta.LLM(str(llama_tiny), dtype="float32").generate(PROMPTS[:2], GREEDY)
    assert [g.token_ids for g in got] == [e.token_ids for e in expected]


def test_quanta_build_refuses_a_tp_size_the_model_cannot_split(llama_tiny, tmp_path):
    from quanta.cli import app
    from typer.testing import CliRunner

    result = CliRunner().invoke(
        app, ["build", str(llama_tiny), "--out", str(tmp_path / "e"), "--tp_size", "4"]
    )
    assert result.exit_code == 1
    assert "--tp_size" in result.output and "num_key_value_heads (2)" in result.output


@pytest.mark.parametrize("preset", ["opt-tiny", "llama-tiny-mha"])
def test_hidden_cache_requests_under_two_ranks_match_one(tiny_checkpoint, preset):
    """Each rank stores its columns of the hidden states and gathers the rest to project
    its K and V heads; mixed with KV requests, chunked and swapped out and back."""
    import dataclasses

    from runner_helpers import FakeRequest, ToyScheduler

    model_dir = tiny_checkpoint(preset)
    prompts = [list(range(5, 24)), [40, 41, 42], list(range(50, 90))]

    def run(tp: int) -> dict[str, list[int]]:
        runner = ModelRunner(
            model_dir,
            num_device_blocks=64,
            num_host_blocks=16,
            block_size=4,
            dtype="float32",
            tensor_parallel_size=tp,
        )
        try:
            assert runner.capabilities.hidden_cache
            requests = [
                FakeRequest(f"r{i}", p, 12, chunk_size=7 if i == 2 else None, arrival_step=i)
                for i, p in enumerate(prompts)
            ]
            toy = ToyScheduler(runner, requests, swaps={3: ("out", "r0"), 6: ("in", "r0")})
            schedule = toy._schedule

            def with_kind(r: FakeRequest) -> ScheduledSeq:
                return dataclasses.replace(schedule(r), hidden=r.request_id in {"r0", "r2"})

            toy._schedule = with_kind  # type: ignore[method-assign]
            return toy.run()
        finally:
            runner.close()

    assert run(2) == run(1)


def test_conserve_checkpoints_under_two_ranks_leave_outputs_unchanged(llama_tiny):
    """ConServe's incremental checkpoints copy each rank's share of the blocks to its host
    tier; offline work that yields to online arrivals by checkpoint comes out as without."""
    from fakes import decode_chars
    from quanta.core.blocks import BlockManager
    from quanta.core.clock import VirtualClock
    from quanta.core.config import SchedulerConfig
    from quanta.core.loop import EngineLoop
    from quanta.core.request import Request, RequestMetadata, SamplingParams
    from quanta.policies import make_policy

    def requests() -> tuple[list[Request], list[Request]]:
        def one(rid: str, prompt_len: int, max_tokens: int, cls: str) -> Request:
            return Request(
                request_id=rid,
                prompt_token_ids=[(3 * len(rid) + 7 * j) % 50 + 4 for j in range(prompt_len)],
                params=SamplingParams(max_tokens=max_tokens, temperature=0.8),
                arrival_time=0.0,
                seed=sum(map(ord, rid)),
                metadata=RequestMetadata(priority_class=cls),  # type: ignore[arg-type]
            )

        offline = [one(f"off{i}", 20, 12, "offline") for i in range(4)]
        return offline, [one(f"on{i}", 10, 6, "online") for i in range(2)]

    def run(policy: str, device: int, tp: int, **options: object) -> tuple[dict, EngineLoop]:
        runner = ModelRunner(
            llama_tiny,
            num_device_blocks=device,
            num_host_blocks=64,
            block_size=4,
            dtype="float32",
            tensor_parallel_size=tp,
        )
        loop = EngineLoop(
            runner=runner,
            policy=make_policy(policy, SchedulerConfig(max_num_batched_tokens=64), **options),
            blocks=BlockManager(4, device, 64),
            clock=VirtualClock(),
            max_model_len=256,
            decode=decode_chars,
        )
        try:
            early, late = requests()
            streams = {r.request_id: loop.submit(r) for r in early}
            for _ in range(4):
                loop.step()
            streams |= {r.request_id: loop.submit(r) for r in late}
            loop.run_until_idle()
        finally:
            runner.close()
        loop.blocks.check_integrity()
        assert loop.blocks.all_free()
        return {rid: s.result(timeout=0).token_ids for rid, s in streams.items()}, loop  # type: ignore[union-attr]

    expected, _ = run("fcfs", 512, 1)
    got, loop = run("conserve", 20, 2, safepoints=False, checkpoint_threshold=1.0, prefetch=False)
    stats = loop.stats()
    assert stats.num_preemptions_checkpoint > 0 and stats.num_checkpoint_blocks_copied > 0
    assert got == expected


def test_a_quantized_engine_is_refused_before_any_cut(llama_tiny, tmp_path):
    from quanta.build.engine_build import BuildOptions, build_engine_dir

    engine = tmp_path / "int8"
    build_engine_dir(llama_tiny, engine, BuildOptions(quantization="int8", kv_cache_memory=1 << 20))
    with pytest.raises(ValueError, match="quantized"):
        _runner(engine, tp=2)
