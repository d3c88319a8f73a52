"""A policy's plan for one iteration: which requests run, which are preempted and how."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from quanta.core.safepoint import AbortRule


class PreemptMode(StrEnum):
    SWAP = "swap"  # KV moves to the host tier
    RECOMPUTE = "recompute"  # KV is dropped; the request prefills prompt + output again


@dataclass(frozen=True, slots=True)
class Preemption:
    request_id: str
    mode: PreemptMode


@dataclass(frozen=True, slots=True)
class Decision:
    """One iteration's plan, applied in order: preempt, swap in, run, then checkpoint.

    ``run`` pairs a request id with the number of new tokens it computes this step (a prefill
    chunk or 1): one mechanism for prefill and decode. ``hidden`` names the runs whose cache is
    hidden states rather than K and V (Apt-Serve); a request that holds a cache keeps its kind,
    so switching it is a recompute-preemption first and a fresh start later.
    """

    run: tuple[tuple[str, int], ...] = ()
    preempt: tuple[Preemption, ...] = ()
    swap_in: tuple[str, ...] = ()
    hidden: frozenset[str] = frozenset()
    # Requests whose KV, up to their computed tokens after this step, is copied to the host
    # tier once the forward pass is done (ConServe's incremental checkpoint): a request whose
    # host copy is complete is later preempted by freeing its device blocks, with no copy.
    checkpoint: tuple[str, ...] = ()
    # Set when the step holds only preemptible work: a request that arrives while it runs and
    # for which the rule says yes stops it at the next layer safepoint (``core/safepoint.py``).
    abort_when: AbortRule | None = None

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.run)
