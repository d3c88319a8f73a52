"""A cost model that learns how far off it is: step times as the engine really takes them.

A profile is measured once, on an idle machine. Then the engine serves beside a gateway,
Triton and a load generator, or on a busier GPU, and every step takes longer than predicted.
A policy that sizes steps by predictions to keep an SLO (ConServe's TPOT budget) then keeps
it only on paper. On the CPU server the online P99 TPOT was 170-240 ms against a 110 ms
target (docs/results/conserve.md).

``CalibratedCost`` is the stages' cost model and an observer at once. After each step it
compares the time the step took with what the base model predicts for the same tokens. Its
predictions are the base model's times the ``quantile`` of the recent ratios, so under a slow
machine the budget shrinks until steps fit the SLO again. Ratios within ``deadband`` of 1
count as 1: where the base model is right (the simulator, whose clock is that model), nothing
changes. Pure Python, like every policy.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import Any

from quanta.core.decision import Decision
from quanta.core.output import RunnerOutput
from quanta.core.request import Request
from quanta.core.view import SchedulerView
from quanta.costmodel import CostModel
from quanta.policies.stages import Observer


class CalibratedCost(Observer):
    """``base``'s step and prefill times scaled by what recent steps really took; every other
    attribute is ``base``'s."""

    def __init__(
        self,
        base: CostModel,
        *,
        window: int = 64,
        quantile: float = 0.9,
        min_steps: int = 8,
        deadband: float = 0.1,
        max_factor: float = 8.0,
    ) -> None:
        if not 0 < quantile <= 1 or window < 1 or min_steps < 1 or max_factor < 1:
            raise ValueError("need 0 < quantile <= 1, window >= 1, min_steps >= 1, max_factor >= 1")
        self.base = base
        self.quantile, self.min_steps = quantile, min_steps
        self.deadband, self.max_factor = deadband, max_factor
        self.factor = 1.0
        self._ratios: deque[float] = deque(maxlen=window)
        self._live: dict[str, Request] = {}

    # -- the cost model the stages read ------------------------------------------------------
    def step_time(self, chunks: Iterable[tuple[int, int]]) -> float:
        return self.base.step_time(chunks) * self.factor

    def prefill_time(self, num_tokens: int, context: int = 0) -> float:
        return self.base.prefill_time(num_tokens, context) * self.factor

    def __getattr__(self, name: str) -> Any:
        # NOTE: only reached for what this class does not define (swap times, sizes)
        if name == "base":  # not set yet (a copy being built): no recursion through it
            raise AttributeError(name)
        return getattr(self.base, name)

    # -- what it learns from -----------------------------------------------------------------
    def on_admit(self, request: Request, view: SchedulerView) -> None:
        self._live[request.request_id] = request

    def on_finish(self, request: Request) -> None:
        self._live.pop(request.request_id, None)

    def on_step(self, decision: Decision, output: RunnerOutput, step_time: float) -> None:
        """Compare the step with the base model's prediction for its tokens. The requests'
        counts already include the step, so each chunk started ``n`` tokens earlier."""
        chunks = []
        for rid, n in decision.run:
            r = self._live.get(rid)
            if r is not None:
                chunks.append((n, max(0, r.num_computed_tokens - n)))
        predicted = self.base.step_time(chunks) if chunks else 0.0
        if predicted <= 0 or step_time <= 0:
            return
        self._ratios.append(step_time / predicted)
        if len(self._ratios) >= self.min_steps:
            self.factor = self._fit()

    def _fit(self) -> float:
        ranked = sorted(self._ratios)
        ratio = ranked[min(len(ranked) - 1, int(self.quantile * len(ranked)))]
        if abs(ratio - 1) <= self.deadband:
            return 1.0
        return min(self.max_factor, max(1 / self.max_factor, ratio))
