"""Layer safepoints and incremental checkpoints in the PyTorch runner (ConServe).

Runner level: a raised signal stops the forward pass at the first safepoint after it, a step
run again after an abort computes exactly what a never-aborted runner does, and checkpoint
copies mirror the device blocks only when the step completes. Loop level, on a real tiny
model: an online request submitted from another thread while an offline prefill runs stops
it, and the outputs equal an uninterrupted run's; a request preempted by swap once its
checkpoint is complete needs no swap-out copy and still produces the same tokens.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from quanta.core.blocks import BlockManager
from quanta.core.clock import WallClock
from quanta.core.config import SchedulerConfig
from quanta.core.decision import Decision, Preemption, PreemptMode
from quanta.core.loop import EngineLoop
from quanta.core.output import (
    LogitsProcessing,
    RunnerCapabilities,
    RunnerOutput,
    ScheduledSeq,
    SchedulerOutput,
)
from quanta.core.policy import Policy
from quanta.core.request import Request, RequestMetadata, SamplingParams
from quanta.core.safepoint import AbortSignal, StepAborted
from quanta.core.view import SchedulerView
from quanta.policies import make_policy
from quanta.runner import ModelRunner
from quanta.runner.models.safepoints import Safepoints, walk_layers
from runner_helpers import build_hf_checkpoint

BLOCK = 4


@pytest.fixture(scope="module")
def tiny(opt_tiny: Path) -> Path:
    return opt_tiny


@pytest.fixture(scope="module", params=["opt", "llama"])
def six_layers(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp(f"{request.param}6")
    build_hf_checkpoint(request.param, path, num_hidden_layers=6)
    return path


def _runner(path: Path, **kwargs: object) -> ModelRunner:
    settings: dict[str, object] = {"num_device_blocks": 32, "num_host_blocks": 16}
    return ModelRunner(path, dtype="float32", block_size=BLOCK, **(settings | kwargs))


PROMPT = [(5 * j + 3) % 200 + 4 for j in range(21)]
TABLE = (9, 2, 14, 5, 0, 11)  # 6 blocks of 4: 24 slots for 21 prompt tokens and 3 more


def _seq(
    tokens: list[int], start: int, table: tuple[int, ...], temperature: float = 0.0
) -> ScheduledSeq:
    """One request's chunk, sampled, with its top-5 log-probabilities (so its logits show)."""
    return ScheduledSeq(
        request_id="r0",
        token_ids=tuple(tokens),
        start_pos=start,
        block_table=table,
        sample=True,
        temperature=temperature,
        top_p=1.0,
        top_k=0,
        seed=7,
        output_index=start - len(PROMPT) + 1 if start else 0,
        processing=LogitsProcessing(logprobs=5),
    )


def _layers(runner: ModelRunner) -> torch.nn.ModuleList:
    inner = runner.model.model
    return inner.decoder.layers if hasattr(inner, "decoder") else inner.layers


def _prefill(temperature: float = 0.0, **fields: object) -> SchedulerOutput:
    return SchedulerOutput(seqs=(_seq(PROMPT, 0, TABLE, temperature),), **fields)  # type: ignore[arg-type]


def _raised() -> AbortSignal:
    signal = AbortSignal()
    signal.raise_at(0.0)
    return signal


def _blocks(cache: torch.Tensor, ids: list[int]) -> torch.Tensor:
    """Blocks ``ids`` of a tier, all layers, K and V."""
    return cache[:, :, ids].clone()


# -- the layer walk -------------------------------------------------------------------------
def test_without_safepoints_the_walk_is_the_plain_enumerate() -> None:
    layers = torch.nn.ModuleList(torch.nn.Identity() for _ in range(3))
    assert isinstance(walk_layers(layers, None), enumerate)  # no per-layer work at all


@pytest.mark.parametrize(
    ("interval", "checks"),
    [(1, [0, 1, 2, 3, 4, 5]), (2, [0, 2, 4]), (3, [0, 3]), (6, [0]), (8, [0])],
)
def test_checks_come_every_interval_layers_but_never_after_the_last(
    interval: int, checks: list[int]
) -> None:
    layers = torch.nn.ModuleList(torch.nn.Identity() for _ in range(6))
    seen: list[int] = []
    ran = [i for i, _ in walk_layers(layers, Safepoints(interval, seen.append))]
    assert ran == list(range(6)) and seen == checks


@pytest.mark.engine
def test_interval_is_validated(tiny: Path) -> None:
    with pytest.raises(ValueError, match="safepoint_interval"):
        _runner(tiny, safepoint_interval=0)
    assert _runner(tiny).capabilities.layer_safepoints


# -- the runner ---------------------------------------------------------------------------
@pytest.mark.engine
def test_a_signal_raised_before_the_step_stops_it_before_the_first_layer(tiny: Path) -> None:
    runner = _runner(tiny, safepoint_interval=4)
    with pytest.raises(StepAborted) as stopped:
        runner.execute(_prefill(abort=_raised()))
    assert stopped.value.layer == 0
    assert stopped.value.elapsed_s is not None and stopped.value.elapsed_s > 0


@pytest.mark.engine
@pytest.mark.parametrize(
    ("interval", "raised_in", "stops_at"),
    [(1, 0, 1), (2, 2, 4), (2, 1, 2), (4, 0, 4), (2, 4, None), (8, 0, None)],
)
def test_a_signal_raised_mid_pass_stops_at_the_next_safepoint(
    six_layers: Path, interval: int, raised_in: int, stops_at: int | None
) -> None:
    """The signal is raised while layer ``raised_in`` runs (a forward hook, as a request
    arriving then would); no safepoint follows the last layer, so the step completes."""
    runner = _runner(six_layers, safepoint_interval=interval)
    signal = AbortSignal()
    hook = _layers(runner)[raised_in].register_forward_hook(lambda *_: signal.raise_at(0.0))
    try:
        if stops_at is None:
            out = runner.execute(_prefill(abort=signal))
            assert out.sampled_token_ids[0] is not None
        else:
            with pytest.raises(StepAborted) as stopped:
                runner.execute(_prefill(abort=signal))
            assert stopped.value.layer == stops_at
    finally:
        hook.remove()


@pytest.mark.engine
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_step_run_again_after_an_abort_matches_a_runner_that_never_aborted(
    six_layers: Path, temperature: float
) -> None:
    aborted, clean = _runner(six_layers, safepoint_interval=1), _runner(six_layers)
    with pytest.raises(StepAborted):
        aborted.execute(_prefill(temperature, abort=_raised()))
    again = aborted.execute(_prefill(temperature, abort=AbortSignal()))  # unraised: no stop
    first = clean.execute(_prefill(temperature))
    assert again.sampled_token_ids == first.sampled_token_ids
    assert again.logprobs == first.logprobs and first.logprobs[0] is not None
    assert torch.equal(aborted.device_kv_cache, clean.device_kv_cache)
    token = first.sampled_token_ids[0]
    assert token is not None
    decode = SchedulerOutput(seqs=(_seq([token], len(PROMPT), TABLE, temperature),))
    after_abort, after_clean = aborted.execute(decode), clean.execute(decode)
    assert after_abort.sampled_token_ids == after_clean.sampled_token_ids
    assert after_abort.logprobs == after_clean.logprobs


@pytest.mark.engine
def test_checkpoint_copies_mirror_the_device_blocks_after_the_step(tiny: Path) -> None:
    runner = _runner(tiny)
    pairs = tuple(zip(TABLE, (3, 12, 7, 1, 15, 8), strict=True))
    runner.execute(_prefill(checkpoint=pairs))
    device = _blocks(runner.device_kv_cache, [d for d, _ in pairs])
    host = _blocks(runner.host_kv_cache, [h for _, h in pairs])
    assert device.abs().sum() > 0  # the prefill's KV, in every layer
    assert torch.equal(host, device)


@pytest.mark.engine
def test_an_aborted_step_copies_no_checkpoint_but_keeps_its_swaps(tiny: Path) -> None:
    runner = _runner(tiny, safepoint_interval=1)
    runner.execute(SchedulerOutput(seqs=(replace(_seq(PROMPT, 0, TABLE), request_id="a"),)))
    swapped = _blocks(runner.device_kv_cache, [9])
    runner.host_kv_cache.fill_(0.5)
    other = (20, 21, 22, 23, 24, 25)
    step = SchedulerOutput(
        seqs=(_seq(PROMPT, 0, other),),
        swap_out=((9, 0),),  # done before the forward pass: it stands
        checkpoint=tuple(zip(other, (3, 12, 7, 1, 15, 8), strict=True)),
        abort=_raised(),
    )
    with pytest.raises(StepAborted):
        runner.execute(step)
    assert torch.equal(_blocks(runner.host_kv_cache, [0]), swapped)
    untouched = _blocks(runner.host_kv_cache, [3, 12, 7, 1, 15, 8])
    assert torch.equal(untouched, torch.full_like(untouched, 0.5))


@pytest.mark.engine
def test_bad_checkpoint_ids_fail_before_anything_is_written(tiny: Path) -> None:
    runner = _runner(tiny)
    before_device, before_host = runner.device_kv_cache.clone(), runner.host_kv_cache.clone()
    with pytest.raises(ValueError, match="out of range"):
        runner.execute(_prefill(swap_out=((1, 2),), checkpoint=((TABLE[0], 16),)))
    assert torch.equal(runner.device_kv_cache, before_device)
    assert torch.equal(runner.host_kv_cache, before_host)


# -- through the loop -----------------------------------------------------------------------
class Recorder:
    """The runner, recording every step it is given and every step it stopped."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.capabilities = runner.capabilities
        self.steps: list[SchedulerOutput] = []
        self.aborted: list[StepAborted] = []

    def execute(self, so: SchedulerOutput) -> RunnerOutput:
        self.steps.append(so)
        try:
            return self.runner.execute(so)
        except StepAborted as stop:
            self.aborted.append(stop)
            raise


class Wrapped:
    """FCFS with a twist a test supplies; forwards everything else to it."""

    name = "test"

    def __init__(self, safepoints: bool = False) -> None:
        self.inner: Policy = make_policy("fcfs", SchedulerConfig(max_num_batched_tokens=64))
        self.requires = RunnerCapabilities(layer_safepoints=safepoints)

    def admit(self, request: Request, view: SchedulerView) -> str | None:
        return self.inner.admit(request, view)

    def schedule(self, view: SchedulerView) -> Decision:
        return self.inner.schedule(view)

    def on_step(self, decision: Decision, output: RunnerOutput, step_time: float) -> None:
        self.inner.on_step(decision, output, step_time)

    def on_finish(self, request: Request) -> None:
        self.inner.on_finish(request)

    def on_abort(self, decision: Decision) -> None:
        self.inner.on_abort(decision)


def _online_stops_it(request: Request, now: float) -> bool:
    return request.metadata.priority_class == "online"


class OfflinePreemptible(Wrapped):
    """A step that runs only offline work may be stopped by any online arrival."""

    def __init__(self) -> None:
        super().__init__(safepoints=True)

    def schedule(self, view: SchedulerView) -> Decision:
        d = self.inner.schedule(view)
        live = {r.request_id: r for r in view.candidates}
        if d.run and all(live[rid].metadata.priority_class == "offline" for rid, _ in d.run):
            return replace(d, abort_when=_online_stops_it)
        return d


class CheckpointThenSwap(Wrapped):
    """Checkpoints every run each step; once ``victim`` has two tokens out and its checkpoint
    holds all its KV, swaps it out (it comes back the next step, through FCFS)."""

    def __init__(self, victim: str) -> None:
        super().__init__()
        self.victim = victim
        self.preempted = False

    def schedule(self, view: SchedulerView) -> Decision:
        d = self.inner.schedule(view)
        victim = next((r for r in view.running if r.request_id == self.victim), None)
        preempt = d.preempt
        run = d.run
        if (
            not self.preempted
            and victim is not None
            and victim.num_output_tokens >= 2
            and view.plan().is_checkpointed(victim)
        ):
            self.preempted = True
            preempt = (*preempt, Preemption(self.victim, PreemptMode.SWAP))
            run = tuple((rid, n) for rid, n in run if rid != self.victim)
        return replace(d, run=run, preempt=preempt, checkpoint=tuple(rid for rid, _ in run))


def _requests(temperature: float, classes: list[str]) -> list[Request]:
    return [
        Request(
            request_id=f"{cls}{i}",
            prompt_token_ids=[(11 * i + 3 * j) % 200 + 4 for j in range(18 + 5 * i)],
            params=SamplingParams(max_tokens=7, temperature=temperature, ignore_eos=True),
            arrival_time=0.0,
            seed=100 + i,
            metadata=RequestMetadata(priority_class=cls),  # type: ignore[arg-type]
        )
        for i, cls in enumerate(classes)
    ]


def _loop(path: Path, policy: Policy, **kwargs: object) -> tuple[EngineLoop, Recorder]:
    runner = Recorder(_runner(path, num_device_blocks=64, num_host_blocks=64, **kwargs))
    loop = EngineLoop(
        runner=runner,
        policy=policy,
        blocks=BlockManager(BLOCK, 64, 64),
        clock=WallClock(),
        max_model_len=128,
    )
    return loop, runner


def _outputs(loop: EngineLoop, streams: dict[str, object]) -> dict[str, list[int]]:
    loop.blocks.check_integrity()
    assert loop.blocks.all_free(), "blocks leaked"
    return {rid: s.result(timeout=0).token_ids for rid, s in streams.items()}  # type: ignore[attr-defined]


def _uninterrupted(path: Path, requests: list[Request]) -> dict[str, list[int]]:
    """Outputs of ``requests`` (fresh ones: a loop changes them) all submitted at once."""
    loop, _ = _loop(path, Wrapped())
    streams = {r.request_id: loop.submit(r) for r in requests}
    loop.run_until_idle()
    return _outputs(loop, streams)


@pytest.fixture
def arrival_hook() -> Iterator[list]:
    """Forward hooks to remove after the test."""
    hooks: list = []
    yield hooks
    for hook in hooks:
        hook.remove()


@pytest.mark.engine
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_an_online_arrival_from_another_thread_stops_the_offline_prefill(
    six_layers: Path, temperature: float, arrival_hook: list
) -> None:
    classes = ["offline", "offline", "offline", "online"]
    reference = _uninterrupted(six_layers, _requests(temperature, classes))
    *offline, online = _requests(temperature, classes)

    loop, runner = _loop(six_layers, OfflinePreemptible(), safepoint_interval=2)
    in_step, submitted = threading.Event(), threading.Event()

    def wait_for_the_arrival(*_: object) -> None:
        """Layer 0 of the first step blocks until the client thread has submitted."""
        if not in_step.is_set():
            in_step.set()
            assert submitted.wait(timeout=30)

    arrival_hook.append(_layers(runner.runner)[0].register_forward_hook(wait_for_the_arrival))
    streams: dict[str, object] = {r.request_id: loop.submit(r) for r in offline}

    def client() -> None:
        assert in_step.wait(timeout=30)
        streams[online.request_id] = loop.submit(online)
        submitted.set()

    thread = threading.Thread(target=client)
    thread.start()
    loop.run_until_idle()
    thread.join()

    assert [stop.layer for stop in runner.aborted] == [2]
    assert runner.steps[0].abort is not None
    assert {s.request_id for s in runner.steps[0].seqs} == {r.request_id for r in offline}
    assert loop.stats().num_safepoint_aborts == 1
    assert loop.last_abort is not None and loop.last_abort[0] <= loop.last_abort[1]
    assert _outputs(loop, streams) == reference


@pytest.mark.engine
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_checkpointed_request_is_swapped_with_no_copy_and_its_tokens_stand(
    six_layers: Path, temperature: float
) -> None:
    reference = _uninterrupted(six_layers, _requests(temperature, ["offline"] * 3))
    requests = _requests(temperature, ["offline"] * 3)
    policy = CheckpointThenSwap(victim="offline1")
    loop, runner = _loop(six_layers, policy)
    streams: dict[str, object] = {r.request_id: loop.submit(r) for r in requests}
    loop.run_until_idle()

    assert policy.preempted, "the victim was never fully checkpointed"
    # its checkpoint already held every block: no step copied anything out
    assert all(so.swap_out == () for so in runner.steps)
    assert any(so.swap_in for so in runner.steps), "the victim came back from its checkpoint"
    assert any(so.checkpoint for so in runner.steps)
    stats = loop.stats()
    assert stats.num_preemptions_checkpoint == 1 and stats.num_preemptions_swap == 0
    assert stats.num_checkpoint_blocks_copied > 0
    assert _outputs(loop, streams) == reference


@pytest.mark.engine
def test_the_engine_config_reaches_the_runner(tiny: Path) -> None:
    from quanta.core.config import EngineConfig
    from quanta.frontends.engine import build_engine
    from quanta.frontends.triton.settings import parse_parameters

    engine_config, _ = parse_parameters({"model_dir": str(tiny), "safepoint_interval": "3"})
    assert engine_config.safepoint_interval == 3
    cache = {"num_device_blocks": 8, "num_host_blocks": 0}
    small = engine_config.model_copy(update={"cache": engine_config.cache.model_copy(update=cache)})
    assert build_engine(small).runner.safepoint_interval == 3
    assert EngineConfig(model=str(tiny)).safepoint_interval == 8
    with pytest.raises(ValueError):
        EngineConfig(model=str(tiny), safepoint_interval=0)


@pytest.mark.engine
def test_bench_safepoints_writes_its_report(tiny: Path, tmp_path: Path) -> None:
    from quanta.cli import app
    from typer.testing import CliRunner

    out = tmp_path / "sp.json"
    args = ["bench", "safepoints", "--model", str(tiny), "--prefill-tokens", "24"]
    args += ["--decode-batch", "2", "--decode-context", "16", "--repeats", "2"]
    args += ["--trials", "3", "--intervals", "1,2", "--output", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert {"model", "dtype", "linear_kernel", "attention_kernel", "num_layers", "rows"} <= set(
        report
    )
    rows = report["rows"]
    assert {(r["workload"], r["interval"]) for r in rows} == {
        (w, k) for w in ("prefill", "decode") for k in (None, 1, 2)
    }
    for row in rows:
        assert row["step_ms"] > 0
        if row["interval"] is not None:
            assert {"overhead_pct", "abort_ms_mean", "abort_ms_p50", "abort_ms_max"} <= set(row)
            assert 1 <= row["trials"] <= 3  # a raise after a tiny step ended is not counted
