"""The hidden cache (Apt-Serve): a request may keep each layer's attention input instead of K
and V, in half the blocks, and get exactly the tokens it would get with K and V.

The runner is checked against HF with hand-built steps (mixed with KV sequences, chunked,
swapped); the engine with a test policy that chooses kinds by rule and switches requests
between them mid-generation (discard and recompute), and the pool's capacity is measured.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Literal

import pytest
import quanta
from pydantic import Field
from quanta.build.checkpoint import ensure_checkpoint
from quanta.core.config import SchedulerConfig
from quanta.core.decision import PreemptMode
from quanta.core.errors import CapabilityError
from quanta.core.output import RunnerCapabilities, ScheduledSeq, SchedulerOutput
from quanta.core.plan import StepPlan
from quanta.core.request import CacheKind, RequestStatus, blocks_for
from quanta.core.view import SchedulerView
from quanta.policies import register_system
from quanta.policies.packers import chunk
from quanta.policies.stages import Lane, Packer, Placement, Ranking
from quanta.policies.systems import Stages, System, SystemOptions
from quanta.runner import ModelRunner
from runner_helpers import FakeRequest, ToyScheduler, build_hf_checkpoint, hf_greedy

MHA_LLAMA = {"num_key_value_heads": 4}


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    root = tmp_path_factory.mktemp("hidden")
    return {
        "opt": (root / "opt", build_hf_checkpoint("opt", root / "opt")),
        "llama-mha": (root / "llama", build_hf_checkpoint("llama", root / "llama", **MHA_LLAMA)),
        "llama-gqa": (root / "gqa", build_hf_checkpoint("llama", root / "gqa")),
    }


def _runner(path: Path, **kwargs: Any) -> ModelRunner:
    settings = {"num_device_blocks": 64, "num_host_blocks": 16, "block_size": 4}
    return ModelRunner(path, dtype="float32", **(settings | kwargs))


def _hidden_toy(runner: ModelRunner, requests: list[FakeRequest], hidden: set[str], **kw: Any):
    """A toy scheduler whose sequences in ``hidden`` run with a hidden cache."""
    toy = ToyScheduler(runner, requests, **kw)
    schedule = toy._schedule

    def with_kind(r: FakeRequest) -> ScheduledSeq:
        return dataclasses.replace(schedule(r), hidden=r.request_id in hidden)

    toy._schedule = with_kind  # type: ignore[method-assign]
    return toy


PROMPTS = [list(range(5, 24)), [40, 41, 42], list(range(50, 90))]


@pytest.mark.engine
@pytest.mark.parametrize("family", ["opt", "llama-mha"])
@pytest.mark.parametrize("kernel", ["eager", "eager-varlen", "compiled-varlen", "native"])
def test_hidden_cache_greedy_equals_hf_in_a_batch_mixed_with_kv(
    hf_models: dict[str, tuple[Path, Any]],
    family: str,
    kernel: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every decode-attention kernel ("-varlen": the torch kernels' batched path, which
    batches this small would otherwise skip for SDPA row by row)."""
    from quanta.runner import decode_kernel

    path, hf = hf_models[family]
    kernel, _, mode = kernel.partition("-")
    if mode == "varlen":
        monkeypatch.setattr(decode_kernel, "ROW_BY_ROW_DECODE_ROWS", 0)
    runner = _runner(path, attention_kernel=kernel)
    if runner.attention_kernel != kernel:
        pytest.skip(f"the {kernel} decode kernel cannot be built here")
    assert runner.capabilities.hidden_cache
    requests = [
        FakeRequest(f"r{i}", p, 12, chunk_size=7 if i == 2 else None, arrival_step=i)
        for i, p in enumerate(PROMPTS)
    ]
    toy = _hidden_toy(runner, requests, hidden={"r0", "r2"})
    out = toy.run()
    assert toy.mixed_steps > 0
    assert out == {f"r{i}": hf_greedy(hf, p, 12) for i, p in enumerate(PROMPTS)}


@pytest.mark.engine
def test_a_swapped_hidden_request_continues_identically(
    hf_models: dict[str, tuple[Path, Any]],
) -> None:
    path, hf = hf_models["llama-mha"]
    requests = [FakeRequest("a", PROMPTS[0], 14), FakeRequest("b", PROMPTS[1], 14)]
    toy = _hidden_toy(
        _runner(path), requests, hidden={"a"}, swaps={3: ("out", "a"), 6: ("in", "a")}
    )
    out = toy.run()
    assert out == {"a": hf_greedy(hf, PROMPTS[0], 14), "b": hf_greedy(hf, PROMPTS[1], 14)}


@pytest.mark.engine
def test_a_hidden_sequence_needs_only_half_the_blocks(
    hf_models: dict[str, tuple[Path, Any]],
) -> None:
    """A table of ceil(context / (2 * block_size)) blocks is enough, and one block short is a
    clear error before anything is written."""
    path, hf = hf_models["opt"]
    runner = _runner(path, num_device_blocks=8)
    prompt = PROMPTS[0]  # 19 tokens: 5 KV blocks of 4, 3 hidden blocks
    assert blocks_for(len(prompt), 4, CacheKind.HIDDEN) == 3
    seq = ScheduledSeq("x", tuple(prompt), 0, (7, 2, 5), True, 0.0, 1.0, 0, 0, 0, hidden=True)
    tokens = [runner.execute(SchedulerOutput((seq,))).sampled_token_ids[0]]
    for i in range(4):  # context 20..23 still fits 3 blocks of 8 hidden tokens
        step = dataclasses.replace(
            seq, token_ids=(tokens[-1],), start_pos=len(prompt) + i, output_index=i + 1
        )
        tokens.append(runner.execute(SchedulerOutput((step,))).sampled_token_ids[0])
    assert tokens == hf_greedy(hf, prompt, 5)
    short = dataclasses.replace(seq, token_ids=(1,), start_pos=24, output_index=5)
    with pytest.raises(ValueError, match="needs 4 blocks"):
        runner.execute(SchedulerOutput((short,)))


@pytest.mark.engine
def test_grouped_query_models_offer_no_hidden_cache(
    hf_models: dict[str, tuple[Path, Any]],
) -> None:
    path, _ = hf_models["llama-gqa"]
    runner = _runner(path)
    assert not runner.capabilities.hidden_cache
    assert ModelRunner.hidden_blocks_ratio(runner.model_config) == 1.0
    before = runner.device_kv_cache.clone()
    seq = ScheduledSeq("x", (1, 2, 3), 0, (0,), True, 0.0, 1.0, 0, 0, 0, hidden=True)
    with pytest.raises(ValueError, match="offers no hidden cache"):
        runner.execute(SchedulerOutput((seq,)))
    assert runner.device_kv_cache.equal(before)
    mha = _runner(hf_models["llama-mha"][0])
    assert ModelRunner.hidden_blocks_ratio(mha.model_config) == 2.0


# --- through the engine: a test policy that picks kinds by rule --------------------------


class _KindOptions(SystemOptions):
    kinds: Literal["hidden", "kv", "alternate"] = "hidden"
    switch_every: int = Field(0, ge=0, description="steps between discarding a resident")


class _KindPacker(Packer):
    """In arrival order, no eviction: each request starts with the kind the rule gives, and
    every ``switch_every`` steps the oldest resident that has produced a token is discarded
    and restarts later with the other kind."""

    requires = RunnerCapabilities(hidden_cache=True)

    def __init__(self, config: SchedulerConfig, options: _KindOptions) -> None:
        self.config, self.options = config, options
        self.steps = 0
        self.next_kind: dict[str, CacheKind] = {}
        self.switches = 0
        self.peak_running = 0

    def pack(
        self,
        lane: Lane,
        view: SchedulerView,
        plan: StepPlan,
        ranking: Ranking,
        placement: Placement,
    ) -> None:
        self.steps += 1
        every = self.options.switch_every
        if every and self.steps % every == 0:
            for req in lane.order:
                held = plan.cache_kind(req)
                if plan.is_resident(req) and held is not None and req.num_output_tokens:
                    plan.preempt_req(req, PreemptMode.RECOMPUTE)
                    other = CacheKind.KV if held is CacheKind.HIDDEN else CacheKind.HIDDEN
                    self.next_kind[req.request_id] = other
                    self.switches += 1
                    break
        # Blocks residents will still need to finish: a start must leave them, so nothing
        # ever has to be evicted for a resident to grow.
        owed = sum(
            self._final(plan, r, plan.cache_kind(r)) - plan.held(r)
            for r in lane.order
            if plan.is_resident(r)
        )
        for req in lane.order:
            if req.request_id in plan.moved or not plan.has_room():
                continue
            kind = plan.cache_kind(req) or self._kind(req)
            n = chunk(req, plan.budget or req.num_uncomputed_tokens, True)
            if not n or not plan.has_room(n):
                continue
            grow = plan.blocks_to_grow(req, n, kind)
            if plan.is_resident(req):
                owed -= grow
            else:
                final = self._final(plan, req, kind)
                if final > plan.free_device - owed:
                    continue
                owed += final - grow
            plan.take(req, n, kind)
        self.peak_running = max(self.peak_running, len(plan.chosen))

    @staticmethod
    def _final(plan: StepPlan, req: Any, kind: CacheKind | None) -> int:
        total = req.num_prompt_tokens + req.params.max_tokens
        return plan.pool.blocks_for(total, kind or CacheKind.KV)

    def _kind(self, req: Any) -> CacheKind:
        if req.request_id in self.next_kind:
            return self.next_kind[req.request_id]
        if self.options.kinds == "alternate":
            odd = sum(map(ord, req.request_id)) % 2
            return CacheKind.HIDDEN if odd else CacheKind.KV
        return CacheKind(self.options.kinds)


PACKERS: list[_KindPacker] = []


def _kind_stages(config: SchedulerConfig, o: _KindOptions) -> Stages:
    PACKERS.append(_KindPacker(config, o))
    return Stages(packer=PACKERS[-1])


register_system(System("test-cache-kinds", _KindOptions, _kind_stages))


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hidden-engines")
    return {
        name: ensure_checkpoint(name, root / name)
        for name in ("opt-tiny", "llama-tiny-mha", "llama-tiny")
    }


def _generate(model: Path, policy: str, options: dict[str, Any], params: Any, **cache: Any):
    llm = quanta.LLM(
        str(model),
        policy=policy,
        policy_options=options,
        cache={"num_device_blocks": 64, "block_size": 4} | cache,
        scheduler={"max_num_batched_tokens": 32},
    )
    prompts = ["The hidden cache", "halves the memory of", "a request, at the cost of", "K, V"]
    results = llm.generate(prompts, params)
    llm.engine.loop.blocks.check_integrity()
    assert llm.engine.loop.blocks.all_free()
    return [r.token_ids for r in results], llm


@pytest.mark.engine
@pytest.mark.parametrize("model", ["opt-tiny", "llama-tiny-mha"])
@pytest.mark.parametrize(
    "options",
    [{"kinds": "hidden"}, {"kinds": "alternate"}, {"kinds": "alternate", "switch_every": 5}],
    ids=["hidden", "hybrid", "switching"],
)
def test_engine_outputs_do_not_depend_on_the_cache_kind(
    engines: dict[str, Path], model: str, options: dict[str, Any]
) -> None:
    params = [
        quanta.SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
        quanta.SamplingParams(max_tokens=20, temperature=0.9, seed=11, ignore_eos=True),
        quanta.SamplingParams(max_tokens=12, temperature=0.7, top_p=0.9, seed=3, ignore_eos=True),
        quanta.SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True),
    ]
    reference, _ = _generate(engines[model], "test-cache-kinds", {"kinds": "kv"}, params)
    tokens, llm = _generate(engines[model], "test-cache-kinds", options, params)
    assert tokens == reference
    if options.get("switch_every"):
        assert PACKERS[-1].switches > 0
        assert llm.engine.loop.stats().num_preemptions_recompute == PACKERS[-1].switches


@pytest.mark.engine
def test_the_pool_holds_twice_as_many_hidden_requests(engines: dict[str, Path]) -> None:
    """Same pool, same prompts: the most requests running at once, KV against hidden."""
    params = quanta.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    peaks = {}
    for kinds in ("kv", "hidden"):
        llm = quanta.LLM(
            str(engines["opt-tiny"]),
            policy="test-cache-kinds",
            policy_options={"kinds": kinds},
            cache={"num_device_blocks": 24, "block_size": 4},
            scheduler={"max_num_seqs": 64, "max_num_batched_tokens": 2048},
        )
        llm.generate([[5 + i] * 8 for i in range(40)], params)  # 15 tokens: 4 KV, 2 hidden blocks
        peaks[kinds] = PACKERS[-1].peak_running
        assert llm.engine.loop.blocks.all_free()
    assert peaks == {"kv": 24 // 4, "hidden": 24 // 2}


@pytest.mark.engine
def test_a_policy_that_needs_the_hidden_cache_refuses_a_grouped_query_model(
    engines: dict[str, Path],
) -> None:
    with pytest.raises(CapabilityError, match="hidden_cache"):
        quanta.LLM(str(engines["llama-tiny"]), policy="test-cache-kinds")


def test_a_running_request_keeps_its_kind_until_it_is_discarded() -> None:
    from quanta.core.blocks import BlockManager
    from quanta.core.errors import PolicyError
    from quanta.core.plan import PoolView
    from quanta.core.request import Request, SamplingParams

    bm = BlockManager(4, 10, 0)
    req = Request("r", [1] * 9, SamplingParams(max_tokens=4), 0.0, 0)
    assert bm.allocate_slots("r", 9, CacheKind.HIDDEN) == [0, 1]
    assert bm.usage(CacheKind.HIDDEN) == (1, 2) and bm.usage(CacheKind.KV) == (0, 0)
    req.num_computed_tokens = 9
    req.set_status(RequestStatus.RUNNING)
    plan = StepPlan(PoolView(bm))
    assert plan.cache_kind(req) is CacheKind.HIDDEN
    with pytest.raises(PolicyError, match="holds hidden"):
        plan.run_req(req, 1, CacheKind.KV)
    plan.preempt_req(req, PreemptMode.RECOMPUTE)
    assert plan.cache_kind(req) is None
    with pytest.raises(RuntimeError, match="holds a hidden cache"):
        bm.allocate_slots("r", 12, CacheKind.KV)
    bm.free("r")
    bm.check_integrity()
    assert bm.all_free()


def test_the_simulator_charges_hidden_requests_their_recomputed_kv() -> None:
    from quanta.core.clock import VirtualClock
    from quanta.costmodel import get_profile
    from quanta.sim.runner import SimRunner

    cost = get_profile("a100-opt13b")
    assert cost.hidden_per_token_s == pytest.approx(cost.compute_per_token_s / 6)
    assert cost.rho(16) == pytest.approx(16 * cost.hidden_per_token_s)
    measured = cost.model_copy(update={"hidden_projection_per_token_s": 2e-6})
    assert measured.hidden_time(500) == pytest.approx(1e-3)
    times = {}
    for hidden in (False, True):
        clock = VirtualClock()
        runner = SimRunner(measured, clock, block_size=16)
        seqs = tuple(
            ScheduledSeq(
                f"r{i}",
                (1,),
                300 + i,
                tuple(range(20)),
                True,
                0.0,
                1.0,
                0,
                0,
                0,
                hidden=hidden and i == 0,
            )
            for i in range(3)
        )
        runner.execute(SchedulerOutput(seqs))
        times[hidden] = clock.now()
    assert times[True] - times[False] == pytest.approx(measured.hidden_time(300))


@pytest.mark.engine
@pytest.mark.parametrize("model", ["opt-tiny", "llama-tiny-mha"])
def test_apt_outputs_equal_fcfs_whatever_the_cache(engines: dict[str, Path], model: str) -> None:
    """The policy ``apt`` on the real engine, in a pool tight enough to preempt: greedy and
    seeded tokens equal FCFS's under every cache option."""
    params = [
        quanta.SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
        quanta.SamplingParams(max_tokens=24, temperature=0.8, seed=5, ignore_eos=True),
    ] * 2
    reference, _ = _generate(engines[model], "fcfs", {}, params)
    for cache in ("hybrid", "hidden", "kv"):
        tokens, _ = _generate(engines[model], "apt", {"cache": cache}, params, num_device_blocks=12)
        assert tokens == reference, cache
