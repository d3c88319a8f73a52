"""Apt-Serve's hybrid cache against its recompute price: a hidden cache is charged for every
step it commits a request to, so the greedy takes it only where it pays. On a small simulated
case the hybrid cache attains at least what KV alone does at any price, and less as the price
rises."""

from __future__ import annotations

import itertools
import random

import pytest
from quanta.core.blocks import BlockManager
from quanta.core.config import SchedulerConfig
from quanta.core.request import Request, RequestStatus
from quanta.costmodel import PROFILES
from quanta.metrics import SLO, attains_slo, from_requests
from quanta.policies.adaptive import AdaptivePacker
from quanta.sim.driver import SimSetup, simulate
from quanta.slo import with_slo
from quanta.workloads import WorkloadRequest
from quanta_lab.sim.apt_repro import APT_SCHEDULER
from test_adaptive_policy import NO_SLO, apt, request, resident, schedule

COST = PROFILES["a100-opt13b"]


# -- the price of a hidden start ------------------------------------------------------------
@pytest.mark.parametrize(("out", "starts_hidden"), [(40, False), (2, True)])
def test_a_hidden_start_is_charged_for_every_step_it_commits_to(out, starts_hidden):
    """Pool 7 of 4-token blocks; a KV resident holds 4. "w" has waited 3 s and fits only as
    hidden states (2 blocks, not 4). (|W| + |R|) * rho * m is 0.4 s a step: cheap for the one
    step after its prefill (out=2), 16 s over the 40 steps it would keep the cache (out=40),
    so it waits for KV room then and the resident decodes."""
    bm = BlockManager(4, 7, 0)
    r = resident(bm, request("r", 16, t=-1.0), last_token=-0.01)
    w = request("w", 16, t=-3.0, out=out)
    decision = schedule(apt(rho=0.05, **NO_SLO), bm, r, w, now=0.0)
    if starts_hidden:
        assert decision.run == (("w", 16),) and decision.hidden == {"w"}
    else:
        assert decision.run == (("r", 1),) and not decision.hidden


def _finished(rid: str, tokens: int) -> Request:
    req = request(rid, 4, out=tokens)
    req.set_status(RequestStatus.RUNNING)
    for _ in range(tokens):
        req.append_token(1, 0.0)
    req.set_status(RequestStatus.FINISHED_LENGTH)
    return req


def test_the_steps_ahead_are_the_mean_output_of_finished_requests():
    packer = AdaptivePacker(SchedulerConfig(), COST)
    fresh = request("x", 4, out=100)
    assert packer.steps_ahead(fresh) == 100  # nothing finished yet: its own bound
    packer.on_finish(_finished("a", 10))
    packer.on_finish(_finished("b", 30))
    assert packer.steps_ahead(fresh) == 20


# -- a small simulated case ------------------------------------------------------------------
PRICES = (0.0, 0.25, 0.5, 1.0, 2.0)  # x the profile's hidden_projection_per_token_s


def _trace(seed: int) -> list[WorkloadRequest]:
    """60 requests at 4 req/s, 300-700 prompt and 20-40 output tokens: on a 150-block pool
    (about 5 of them at once as KV) memory binds."""
    rng = random.Random(seed)
    t, rows = 0.0, []
    for i in range(60):
        t += rng.expovariate(4.0)
        rows.append(WorkloadRequest(t, rng.randint(300, 700), rng.randint(20, 40), f"r{i}"))
    return rows


def _attainment(trace: list[WorkloadRequest], slo: SLO, cache: str, price: float) -> float:
    per_token = COST.hidden_per_token_s * price
    profile = COST.model_copy(update={"hidden_projection_per_token_s": per_token})
    setup = SimSetup(
        "apt",
        profile,
        APT_SCHEDULER,
        num_device_blocks=150,
        num_host_blocks=0,
        policy_options={"cache": cache},
    )
    records = from_requests(simulate(trace, setup).requests)
    return sum(attains_slo(r, slo) for r in records) / len(records)


def test_hybrid_is_at_least_kv_only_and_monotone_in_the_recompute_price():
    slo = SLO(ttft_s=0.5, tpot_s=1.0)
    trace = with_slo(_trace(0), slo)
    kv = _attainment(trace, slo, "kv", 1.0)
    hybrid = [_attainment(trace, slo, "hybrid", price) for price in PRICES]
    assert all(h >= kv for h in hybrid)
    assert all(a >= b for a, b in itertools.pairwise(hybrid))  # dearer, no better
    assert hybrid[0] > kv + 0.1  # a free recompute pays: the pool holds twice the requests
    assert hybrid[PRICES.index(1.0)] == kv  # at the roofline's price it never pays here
