"""Faults injected on purpose, for tests only: how the loop's containment is tested for real.

Off unless configured (the Triton model parameter ``fault_injection`` or the environment
variable ``QUANTA_FAULT_INJECTION``; never set them in production). A spec is a
comma-separated list of ``site:seed``: a request whose ``seed`` is ``seed`` meets the fault at
``site`` (a bare ``site`` matches every request). Why the seed: it reaches the engine
unchanged through every frontend (the OpenAI ``seed``, Triton's ``seed`` input), so a test
can aim a fault at one request among others.

Sites, each in the code path its name says:

- ``apply``: the applier raises while it schedules the request (after its blocks are taken);
- ``runner``: the runner raises after a forward pass that computed the request's row;
- ``commit``: the committer raises while it commits the request's step;
- ``detokenize``: the request's detokenizer raises;
- ``step``: the loop raises outside any one request's handling (uncontainable: the loop dies);
- ``stall``: the loop blocks inside a step until it is stopped (the watchdog's case).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field

from quanta.core.request import Request

ENV = "QUANTA_FAULT_INJECTION"
SITES = ("apply", "runner", "commit", "detokenize", "step", "stall")


class InjectedFault(RuntimeError):
    """Raised at a fault site; never raised unless a fault was configured."""


@dataclass(frozen=True)
class FaultPlan:
    """Which requests meet a fault where: site -> seeds (None in the set: every request)."""

    sites: dict[str, frozenset[int | None]] = field(default_factory=dict)
    # set by ``EngineLoop.stop``: a stalled step goes on (so the thread can be joined)
    released: threading.Event = field(default_factory=threading.Event, compare=False)

    @classmethod
    def parse(cls, spec: str) -> FaultPlan:
        """``"commit:4242,stall:777"``; raises ``ValueError`` naming a bad entry."""
        sites: dict[str, set[int | None]] = {}
        for entry in (e.strip() for e in spec.split(",")):
            if not entry:
                continue
            site, _, seed = entry.partition(":")
            if site not in SITES:
                raise ValueError(f"fault_injection: unknown site {site!r} (one of {SITES})")
            try:
                value = int(seed) if seed else None
            except ValueError:
                raise ValueError(
                    f"fault_injection: {entry!r}: the seed is not an integer"
                ) from None
            sites.setdefault(site, set()).add(value)
        return cls({site: frozenset(seeds) for site, seeds in sites.items()})

    @classmethod
    def from_env(cls) -> FaultPlan | None:
        spec = os.environ.get(ENV, "").strip()
        return cls.parse(spec) if spec else None

    def hits(self, site: str, request: Request) -> bool:
        seeds = self.sites.get(site)
        return bool(seeds) and (None in seeds or request.params.seed in seeds)

    def check(self, site: str, request: Request) -> None:
        """Raise ``InjectedFault`` if ``request`` meets the fault at ``site``."""
        if self.hits(site, request):
            raise InjectedFault(f"injected fault at {site} for {request.request_id}")

    def check_any(self, site: str, requests: Iterable[Request]) -> None:
        for r in requests:
            self.check(site, r)

    def stall(self, requests: Iterable[Request]) -> None:
        """Block (until released) when one of ``requests`` meets the ``stall`` fault."""
        if "stall" in self.sites and any(self.hits("stall", r) for r in requests):
            self.released.wait()
