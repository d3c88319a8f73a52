"""Admission stages that throttle: FairServe's OIT and the plain RPM limit it replaces.

- ``RPMAdmission``: at most ``limit`` requests per user per ``window_s``, always, blind to
  load and to interactions (the industry default the paper measures against): a call in the
  middle of an interaction is refused like any other, wasting what the interaction spent.
- ``OITAdmission`` (overload- and interaction-driven throttling, FairServe §4.2): limits are
  checked only while the KV cache is overloaded (device pool at least ``watermark`` full with
  requests waiting), and never for a call that continues an open interaction (it waits
  instead). Otherwise the user's limit is checked, then the app's. Every arrival counts
  toward both windows, refused or not (Algorithm 1, line 19).

A refusal's reason reaches the client as a throttling error (HTTP 429 through the OpenAI
gateway), naming the limit that was hit.
"""

from __future__ import annotations

from pydantic import Field

from quanta.core.config import SchedulerConfig
from quanta.core.request import Request
from quanta.core.view import SchedulerView
from quanta.policies.fair_state import SlidingWindows, Windows
from quanta.policies.fair_stores import fairness_state
from quanta.policies.interactions import InteractionTracker
from quanta.policies.stages import Admission
from quanta.policies.systems import SharedStateOptions, Stages, System


class RPMAdmission(Admission):
    def __init__(self, *, limit: int, window_s: float, windows: Windows | None = None) -> None:
        if limit < 1:
            raise ValueError(f"rpm_limit must be >= 1, got {limit}")
        self.limit = limit
        self.windows = windows if windows is not None else SlidingWindows(window_s)

    def admit(self, request: Request, view: SchedulerView) -> str | None:
        user = request.metadata.tenant
        n = self.windows.note(user, view.now)
        if n <= self.limit:
            return None
        return (
            f"throttled: user {user!r} sent {n} requests in {self.windows.window_s:g} s "
            f"(limit {self.limit}); retry after {self.windows.window_s:g} s"
        )


class OITAdmission(Admission):
    def __init__(
        self,
        tracker: InteractionTracker,
        *,
        user_limit: int,
        app_limit: int,
        window_s: float,
        watermark: float,
        users: Windows | None = None,
        apps: Windows | None = None,
    ) -> None:
        if user_limit < 1 or app_limit < 1:
            raise ValueError("user_limit and app_limit must be >= 1")
        if not 0 < watermark <= 1:
            raise ValueError(f"overload_watermark must be in (0, 1], got {watermark}")
        self.tracker = tracker
        self.user_limit, self.app_limit, self.watermark = user_limit, app_limit, watermark
        self.users = users if users is not None else SlidingWindows(window_s)
        self.apps = apps if apps is not None else SlidingWindows(window_s)

    def overloaded(self, view: SchedulerView, newcomer: Request | None = None) -> bool:
        """The KV cache is overloaded: the device pool is ``watermark`` full and requests
        (other than ``newcomer``) are waiting for it."""
        used = view.total_device_blocks - view.free_device_blocks
        full = used >= self.watermark * view.total_device_blocks
        return full and any(r is not newcomer for r in view.waiting)

    def admit(self, request: Request, view: SchedulerView) -> str | None:
        meta = request.metadata
        n_user = self.users.note(meta.tenant, view.now)
        n_app = self.apps.note(meta.app, view.now)
        if not self.overloaded(view, request) or self.tracker.continues(request, view.now):
            return None
        window = f"{self.users.window_s:g} s"
        if n_user > self.user_limit:
            return (
                f"throttled: user {meta.tenant!r} sent {n_user} requests in {window} "
                f"(limit {self.user_limit}) while the server is overloaded; retry after {window}"
            )
        if n_app > self.app_limit:
            return (
                f"throttled: app {meta.app!r} received {n_app} requests in {window} "
                f"(limit {self.app_limit}) while the server is overloaded; retry after {window}"
            )
        return None


class RPMOptions(SharedStateOptions):
    rpm_limit: int = Field(20, ge=1, description="requests per user per window")
    window_s: float = Field(60.0, gt=0)


def _rpm(config: SchedulerConfig, o: RPMOptions) -> Stages:
    windows = fairness_state(o.state_url).windows("rpm", o.window_s)
    return Stages(admission=RPMAdmission(limit=o.rpm_limit, window_s=o.window_s, windows=windows))


SYSTEMS = [System("rpm", RPMOptions, _rpm, doc="requests per minute")]
