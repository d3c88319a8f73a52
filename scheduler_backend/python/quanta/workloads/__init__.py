"""Workloads: who sends what, when — one data model, one file format, one set of generators
and transformations for ``quanta bench``, ``quanta simulate`` and Locust.

A workload is a list of ``WorkloadRequest``: an arrival offset, a prompt (length, optionally
text), an output length, and the scheduling metadata the policies read (tenant, app,
interaction, online/offline class, SLOs). Every tool reads the same files (``save_workload`` /
``load_workload``: JSONL, or a BurstGPT or Azure CSV trace), so a simulated run and a live
run can be fed exactly the same requests.

One module per concern: ``model`` (the request), ``lengths`` (length samplers, ``DATASETS``),
``arrivals`` (renewal processes, rate schedules), ``tenants`` (tenants, apps, interactions,
offline batches), ``agents`` (FairServe-like multi-call interactions and abusers), ``chat``
(multi-turn conversations, each turn resending the conversation so far), ``prompts``
(the token ids of a row without text, shared exactly along its prefix group),
``transforms`` (merge, rebase, rescale, fit to a model), ``files`` (load and
save; formats in ``jsonl`` and ``csv_traces``) and ``options`` (the command-line options of
tools that read workload files). Pure Python: the simulator imports it.
"""

from __future__ import annotations

import random
from pathlib import Path

from quanta.workloads.agents import AGENTS, AgentApp, agent_apps, agents
from quanta.workloads.arrivals import Arrivals, RateSchedule, arrival_times, on_off, ramp
from quanta.workloads.chat import CHAT, ChatApp, chat, chat_apps
from quanta.workloads.files import load_workload, save_workload
from quanta.workloads.lengths import (
    AZURE_CONV_OUTPUT,
    DATASETS,
    SHAREGPT_INPUT,
    LengthDist,
    LengthSampler,
    LogNormalCount,
    QuantileCount,
    TokenCount,
    UniformLengths,
    length_sampler,
)
from quanta.workloads.model import (
    CLASSES,
    PriorityClass,
    WorkloadError,
    WorkloadRequest,
)
from quanta.workloads.prompts import DEFAULT_ID_RANGE, PromptIds, prompt_ids
from quanta.workloads.tenants import (
    App,
    Tenant,
    offline_batch,
    synthesize,
    tenant_mix,
    with_tenants,
)
from quanta.workloads.transforms import (
    TOO_LONG,
    TooLong,
    fit_to_model,
    merge,
    rebase,
    scale_time,
    scale_to_rate,
    scale_tokens,
    with_io_ratio,
)


def make_workload(
    name_or_path: str,
    num_requests: int,
    rate: float,
    *,
    seed: int = 0,
    cv: float = 1.0,
    max_len: int = 2048,
    time_scale: float = 1.0,
    token_scale: float = 1.0,
    too_long: TooLong = "error",
    num_users: int | None = None,
    abusers: int | None = None,
    abuse_factor: float | None = None,
    tenants: str | None = None,
) -> list[WorkloadRequest]:
    """The simulator's entry point: a dataset name, ``agents``, ``chat``, or a workload file.

    A dataset draws all lengths (redrawn until they fit ``max_len``), then Poisson/Gamma
    arrivals from one ``Random(seed)``: this order keeps seeded simulations (and the
    published tables) unchanged. A file's first ``num_requests`` requests by arrival are
    used, times rebased to 0; a file without times gets arrivals from ``rate``/``cv``;
    ``time_scale``, ``token_scale`` and ``too_long`` act as in ``load_workload`` (a row longer
    than ``max_len`` is an error unless ``too_long`` is ``skip`` or ``clip``).
    ``agents`` is ``quanta.workloads.agents.agents`` with ``num_users`` (default 20) benign
    users and ``abusers`` (default 0) who start interactions ``abuse_factor`` (default 15)
    times as often, which no other workload takes. ``chat`` is
    ``quanta.workloads.chat.chat`` with its defaults (``rate``: turns per second).
    ``tenants`` (``tenant_mix``'s syntax, ``"victim:1,sybil*:8"``) draws each request's
    tenant of a dataset or a file by weight (``with_tenants``); agents and chat have their
    own users.
    """
    shaping = (num_users, abusers, abuse_factor)
    if name_or_path != AGENTS and any(x is not None for x in shaping):
        raise WorkloadError(
            f"num_users, abusers and abuse_factor shape the {AGENTS!r} workload only"
        )
    if tenants is not None:
        if name_or_path in (AGENTS, CHAT):
            raise WorkloadError(f"the {name_or_path!r} workload has its own users; no tenants")
        mix = tenant_mix(tenants)
        rows = make_workload(
            name_or_path,
            num_requests,
            rate,
            seed=seed,
            cv=cv,
            max_len=max_len,
            time_scale=time_scale,
            token_scale=token_scale,
            too_long=too_long,
        )
        return with_tenants(rows, mix, seed=seed)
    if name_or_path in (*DATASETS, AGENTS, CHAT):
        if time_scale != 1.0 or token_scale != 1.0:
            raise WorkloadError(
                "time_scale and token_scale rescale a workload file; a dataset's arrivals "
                "come from the rate and its lengths from the dataset"
            )
        if name_or_path == AGENTS:
            users = 20 if num_users is None else num_users
            return agents(
                num_requests,
                rate,
                num_users=users,
                abusers=abusers or 0,
                abuse_factor=15.0 if abuse_factor is None else abuse_factor,
                seed=seed,
                cv=cv,
                max_len=max_len,
            )
        if name_or_path == CHAT:
            return chat(num_requests, rate, seed=seed, cv=cv, max_len=max_len)
        rng = random.Random(seed)
        dist = DATASETS[name_or_path]
        lengths = [dist.sample(rng, max_len) for _ in range(num_requests)]
        times = arrival_times(num_requests, rate, rng, cv)
        return [
            WorkloadRequest(t, i, o, request_id=f"r{k}")
            for k, (t, (i, o)) in enumerate(zip(times, lengths, strict=True))
        ]
    path = Path(name_or_path)
    if not path.is_file():
        known = ", ".join(sorted((*DATASETS, AGENTS, CHAT)))
        raise WorkloadError(f"workload {name_or_path!r} is neither a dataset ({known}) nor a file")
    rows = load_workload(
        path,
        rate=rate,
        cv=cv,
        seed=seed,
        limit=num_requests,
        time_scale=time_scale,
        token_scale=token_scale,
        too_long=too_long,
        max_len=max_len,
    )
    return rebase(rows)


__all__ = [
    "AGENTS",
    "AZURE_CONV_OUTPUT",
    "CHAT",
    "CLASSES",
    "DATASETS",
    "DEFAULT_ID_RANGE",
    "SHAREGPT_INPUT",
    "TOO_LONG",
    "AgentApp",
    "App",
    "Arrivals",
    "ChatApp",
    "LengthDist",
    "LengthSampler",
    "LogNormalCount",
    "PriorityClass",
    "PromptIds",
    "QuantileCount",
    "RateSchedule",
    "Tenant",
    "TokenCount",
    "TooLong",
    "UniformLengths",
    "WorkloadError",
    "WorkloadRequest",
    "agent_apps",
    "agents",
    "arrival_times",
    "chat",
    "chat_apps",
    "fit_to_model",
    "length_sampler",
    "load_workload",
    "make_workload",
    "merge",
    "offline_batch",
    "on_off",
    "prompt_ids",
    "ramp",
    "rebase",
    "save_workload",
    "scale_time",
    "scale_to_rate",
    "scale_tokens",
    "synthesize",
    "tenant_mix",
    "with_io_ratio",
    "with_tenants",
]
