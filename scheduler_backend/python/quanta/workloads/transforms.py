"""Whole-workload transformations: merge, shift, stretch in time, rescale lengths, and fit
rows to a model's length.

``scale_time``, ``scale_tokens`` and ``fit_to_model`` are what every tool that reads a
workload file applies (``--time-scale``, ``--token-scale``, ``--too-long``): a real trace is
rarely at the rate or the lengths a small testbed serves, and it says so by its options rather
than by a converted copy of the trace.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Literal

from quanta.workloads.model import WorkloadError, WorkloadRequest

TooLong = Literal["error", "skip", "clip"]
TOO_LONG: tuple[TooLong, ...] = ("error", "skip", "clip")


def merge(*workloads: Sequence[WorkloadRequest]) -> list[WorkloadRequest]:
    """One workload ordered by arrival; request ids must not collide."""
    out = sorted(itertools.chain(*workloads), key=lambda r: r.arrival_time)
    ids = [r.request_id for r in out]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise WorkloadError(f"request id {dup!r} appears twice; use distinct id_prefix values")
    return out


def rebase(requests: Sequence[WorkloadRequest]) -> list[WorkloadRequest]:
    """Shift times so the first request arrives at 0."""
    t0 = min((r.arrival_time for r in requests), default=0.0)
    return [replace(r, arrival_time=r.arrival_time - t0) for r in requests]


def scale_to_rate(requests: Sequence[WorkloadRequest], rate: float) -> list[WorkloadRequest]:
    """Stretch or squeeze a trace's times so its mean rate is ``rate`` (bursts keep their
    shape): how ConServe replays BurstGPT at the rate a small testbed can serve."""
    out = rebase(requests)
    last = max((r.arrival_time for r in out), default=0.0)
    if len(out) < 2 or last <= 0 or rate <= 0:
        raise WorkloadError("need >= 2 requests spread over time and rate > 0")
    factor = (len(out) - 1) / rate / last
    return [_retimed(r, lambda t: t * factor) for r in out]


def scale_time(requests: Sequence[WorkloadRequest], time_scale: float) -> list[WorkloadRequest]:
    """Every arrival offset, and so every inter-arrival gap, divided by ``time_scale``: 2.0
    replays the trace twice as fast, 0.5 at half speed; bursts keep their shape (and think
    times between an interaction's calls shrink alike)."""
    _check_scale(time_scale, "time_scale")
    if time_scale == 1.0:
        return list(requests)
    return [_retimed(r, lambda t: t / time_scale) for r in requests]


def scale_tokens(requests: Sequence[WorkloadRequest], token_scale: float) -> list[WorkloadRequest]:
    """Every prompt (context) length multiplied by ``token_scale``, rounded, at least 1;
    output lengths are kept. A prompt given as text becomes a prompt of the scaled length
    (synthetic token ids), since text cannot be scaled; given as ids, it keeps its first ids
    when it shrinks and becomes synthetic when it grows. A shared prefix scales alike."""
    _check_scale(token_scale, "token_scale")
    if token_scale == 1.0:
        return list(requests)
    out = []
    for r in requests:
        n_in = max(1, round(r.prompt_tokens * token_scale))
        system, prefix = (round(n * token_scale) for n in (r.system_tokens, r.prefix_tokens))
        out.append(_with_prompt(r, n_in, system, prefix, prompt=None))
    return out


def fit_to_model(
    request: WorkloadRequest, max_len: int, too_long: TooLong
) -> WorkloadRequest | None:
    """``request`` if prompt + output fits ``max_len``; otherwise, by ``too_long``: raise
    (``error``), drop it (``skip``: None), or shorten it (``clip``: the prompt, and the
    output too when it alone leaves no room for a one-token prompt).

    NOTE: the error names the lengths but not the place; readers prefix ``path:line``.
    """
    if too_long not in TOO_LONG:
        raise WorkloadError(f"too_long must be one of {', '.join(TOO_LONG)}, got {too_long!r}")
    if max_len < 2:
        raise WorkloadError(f"max_len must be >= 2, got {max_len}")
    n_in, n_out = request.prompt_tokens, request.output_tokens
    if n_in + n_out <= max_len:
        return request
    if too_long == "skip":
        return None
    if too_long == "clip":
        n_out = min(n_out, max_len - 1)
        n_in = min(n_in, max_len - n_out)
        text = request.prompt if n_in == request.prompt_tokens else None
        clipped = _with_prompt(
            request, n_in, request.system_tokens, request.prefix_tokens, prompt=text
        )
        return replace(clipped, output_tokens=n_out)
    raise WorkloadError(
        f"{n_in} prompt + {n_out} output tokens = {n_in + n_out} > max_len {max_len}; "
        "to drop such rows use too_long='skip' (--too-long skip), to shorten them "
        "too_long='clip' (--too-long clip)"
    )


def with_io_ratio(
    trace: Sequence[WorkloadRequest], ratio: float, max_len: int
) -> list[WorkloadRequest]:
    """FastServe Fig. 14: the same jobs with mean input / mean output = ``ratio``.

    Every input length is scaled by one factor and every output length by another, so each
    distribution keeps its shape while the mean total length is preserved; lengths are then
    clipped to [1, max_len - 1] and to the model.
    """
    if ratio <= 0 or not trace:
        raise WorkloadError("need ratio > 0 and a non-empty trace")
    mean_in = sum(r.prompt_tokens for r in trace) / len(trace)
    mean_out = sum(r.output_tokens for r in trace) / len(trace)
    total = mean_in + mean_out
    a, b = total * ratio / (1 + ratio) / mean_in, total / (1 + ratio) / mean_out
    out = []
    for r in trace:
        n_in = min(max_len - 1, max(1, round(r.prompt_tokens * a)))
        n_out = min(max_len - n_in, max(1, round(r.output_tokens * b)))
        system, prefix = round(r.system_tokens * a), round(r.prefix_tokens * a)
        scaled = _with_prompt(r, n_in, system, prefix, prompt=r.prompt)
        out.append(replace(scaled, output_tokens=n_out))
    return out


def _check_scale(value: float, name: str) -> None:
    if not (math.isfinite(value) and value > 0):
        raise WorkloadError(f"{name} must be a finite number > 0, got {value!r}")


def _with_prompt(
    r: WorkloadRequest,
    prompt_tokens: int,
    system_tokens: int,
    prefix_tokens: int,
    *,
    prompt: str | None,
) -> WorkloadRequest:
    """``r`` with a new prompt length; its system prompt and shared prefix never exceed the
    prompt, and its ids (a trace's) are cut to it, or dropped when it grew past them."""
    ids = r.prompt_token_ids
    return replace(
        r,
        prompt_tokens=prompt_tokens,
        system_tokens=min(system_tokens, prompt_tokens),
        prompt=prompt,
        prefix_tokens=min(prefix_tokens, prompt_tokens),
        prompt_token_ids=ids[:prompt_tokens] if ids and prompt_tokens <= len(ids) else None,
    )


def _retimed(r: WorkloadRequest, scale: Callable[[float], float]) -> WorkloadRequest:
    """``r`` on a rescaled time axis: its arrival and its think time."""
    if not r.think_time_s:
        return replace(r, arrival_time=scale(r.arrival_time))
    return replace(r, arrival_time=scale(r.arrival_time), think_time_s=scale(r.think_time_s))
