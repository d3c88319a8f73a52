"""FairServe's figures of a simulated run (§5): what throttling cost, who waited, who got
answers, and how evenly users were served.

Why its own module: these figures are about *interactions* and *users* (an answer needs every
call of an interaction), which the per-request latency metrics cannot see. Definitions:

- An interaction is the calls sharing an ``interaction_id`` (a call without one is its own).
  It is *answered* when its last call finished without error: the call marked
  ``interaction_last``, else its latest call in the trace (a trace cut short).
- ``throttled_requests``: calls the policy refused at admission (``ThrottledError``);
  ``throttled_interactions``: interactions with at least one; ``abandoned_requests``: calls
  never sent because an earlier call of their interaction failed or was throttled.
- ``wasted_tokens``: prompt + output tokens computed for calls of interactions that were not
  answered (a prompt counts once it produced a token; recomputation is not counted).
- Users who *sent* anything (a call that was not abandoned) are the denominators:
  ``delayed_users_fraction`` of them had a call queue longer than ``delay_threshold_s`` (first
  scheduled - sent), ``served_users_fraction`` of them had an answered interaction.
  ``delayed_within_users_fraction`` counts only calls that continue an interaction (stage
  1 on): the waits FairServe's §5.2 credits WSC with removing, read apart from a first
  call's wait, which the paper's equal TTFTs (42.57 s VTC, 42.53 s FairServe) rule out as
  what its 0.93% counts.
- ``service_provided_requests`` / ``service_provided_interactions`` (Table 3): the share of all
  calls that finished without error / of interactions answered; ``completed_*`` are the counts.
- ``jain_index``: Jain's index over users' normalized service, FairServe's Eq. 3 with E = 1:
  each call's computed tokens weighted input x1, system prompt x2, output x1, divided by the
  mean weighted tokens the trace's calls of the same app and stage ask for.
- Service against the fair share (per tenant in ``by_tenant``): over the *load period*, from
  the start until the last interaction was started (the last call sent on its own schedule;
  later calls follow answers, so they trail the backlog; after it the backlog only drains,
  and every policy ends up serving everything it admitted), ``service_in_load`` is the
  normalized service a user's calls computed by then and ``fair_share`` its max-min fair
  share of what all users got in that period: the total is water-filled over the users'
  demands (the normalized service their calls sent in the period asked for, refused ones
  included), so a user asking
  less than an equal split is owed all it asked and the rest is split evenly among the
  others. ``share_received`` is the ratio. A benign user below 1 was served less than fair
  queueing owes it, whether by waiting behind others or by being refused.
- The benign users' figures (``benign_figures``, from ``by_tenant``; the agents workload
  names its abusers ``abuser<k>``): ``benign_delayed``, the share of benign users who were
  delayed; ``benign_share``, their service in the load period over their fair shares, all
  together; ``worst_benign_share``, the lowest ``share_received`` among them.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

from quanta.core.request import Request
from quanta.metrics import jain_index, mean

INPUT_WEIGHT, SYSTEM_WEIGHT, OUTPUT_WEIGHT = 1.0, 2.0, 1.0  # FairServe's alpha, beta, gamma


@dataclass
class _User:
    requests: int = 0
    sent: int = 0
    throttled: int = 0
    abandoned: int = 0
    interactions: set[str] = field(default_factory=set)
    answered: set[str] = field(default_factory=set)
    service: float = 0.0
    wasted_tokens: int = 0
    queueing: list[float] = field(default_factory=list)
    queueing_within: list[float] = field(default_factory=list)  # stage 1 on
    demand: float = 0.0  # normalized service asked by calls sent in the load period
    in_load: float = 0.0  # normalized service computed in the load period
    fair_share: float = math.nan

    def row(self, threshold: float) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "throttled": self.throttled,
            "abandoned": self.abandoned,
            "interactions": len(self.interactions),
            "completed_interactions": len(self.answered),
            "service": self.service,
            "wasted_tokens": self.wasted_tokens,
            "mean_queueing_s": mean(self.queueing),
            "delayed": any(q > threshold for q in self.queueing),
            "delayed_within": any(q > threshold for q in self.queueing_within),
            "service_in_load": self.in_load,
            "fair_share": self.fair_share,
            "share_received": self.in_load / self.fair_share if self.fair_share else math.nan,
        }


def fairness(
    requests: Sequence[Request],
    throttled: Collection[str] = frozenset(),
    abandoned: Collection[str] = frozenset(),
    *,
    delay_threshold_s: float = 2.0,
) -> dict[str, Any]:
    """The figures of the module doc; ``throttled`` and ``abandoned`` are request ids (a
    ``SimResult``'s)."""
    never_sent = set(abandoned)
    answered = _answered_interactions(requests)
    expected = _expected_tokens(requests)
    users: dict[str, _User] = defaultdict(_User)
    load_end = max((r.arrival_time for r in requests if _opens(r, never_sent)), default=0.0)
    for r in requests:
        meta, user, key = r.metadata, users[r.metadata.tenant], _interaction(r)
        user.requests += 1
        user.interactions.add(key)
        if key in answered:
            user.answered.add(key)
        if r.request_id in never_sent:
            user.abandoned += 1
            continue
        user.sent += 1
        user.throttled += r.request_id in throttled
        if r.first_scheduled_time is not None:
            user.queueing.append(r.first_scheduled_time - r.arrival_time)
            if meta.interaction_stage:
                user.queueing_within.append(user.queueing[-1])
        prefilled = r.first_token_time is not None
        w = expected[(meta.app, meta.interaction_stage)]
        user.service += _weighted(r, prefilled) / w
        if r.arrival_time <= load_end:
            user.demand += _weighted(r, output=r.params.max_tokens) / w
            user.in_load += _weighted_by(r, load_end) / w
        if key not in answered:
            user.wasted_tokens += r.num_prompt_tokens * prefilled + r.num_output_tokens
    senders = [u for u in users.values() if u.sent]
    _set_fair_shares(senders)
    rows = {name: users[name].row(delay_threshold_s) for name in sorted(users)}
    sent = [rows[name] for name, u in users.items() if u.sent]  # the senders' rows
    hit = {_interaction(r) for r in requests if r.request_id in throttled}
    done = [r for r in requests if r.finish_time is not None and r.error is None]
    num_interactions = len({_interaction(r) for r in requests})
    return {
        "delay_threshold_s": delay_threshold_s,
        "num_users": len(senders),
        "num_interactions": num_interactions,
        "throttled_requests": sum(u.throttled for u in users.values()),
        "throttled_interactions": len(hit),
        "abandoned_requests": len(never_sent),
        "wasted_tokens": sum(u.wasted_tokens for u in users.values()),
        "delayed_users_fraction": _share(sum(r["delayed"] for r in sent), len(sent)),
        "delayed_within_users_fraction": _share(sum(r["delayed_within"] for r in sent), len(sent)),
        "served_users_fraction": _share(sum(bool(u.answered) for u in senders), len(senders)),
        "completed_requests": len(done),
        "completed_interactions": len(answered),
        "service_provided_requests": _share(len(done), len(requests)),
        "service_provided_interactions": _share(len(answered), num_interactions),
        "jain_index": jain_index([u.service for u in senders]),
        "by_tenant": rows,
    }


def _interaction(r: Request) -> str:
    iid = r.metadata.interaction_id
    return f"request:{r.request_id}" if iid is None else iid


def _answered_interactions(requests: Sequence[Request]) -> set[str]:
    """Interactions whose last call finished without error."""
    last: dict[str, tuple[tuple[bool, int, int], Request]] = {}
    for i, r in enumerate(requests):
        meta = r.metadata
        stage = -1 if meta.interaction_stage is None else meta.interaction_stage
        rank, key = (meta.interaction_last, stage, i), _interaction(r)
        if key not in last or rank > last[key][0]:
            last[key] = (rank, r)
    return {k for k, (_, r) in last.items() if r.finish_time is not None and r.error is None}


def _weighted(r: Request, prefilled: bool = True, output: int | None = None) -> float:
    """FairServe's weighted tokens of ``r``: of its prompt if ``prefilled``, and of
    ``output`` output tokens (default: those it produced)."""
    system = r.metadata.system_tokens
    prompt = INPUT_WEIGHT * (r.num_prompt_tokens - system) + SYSTEM_WEIGHT * system
    done = r.num_output_tokens if output is None else output
    return prompt * prefilled + OUTPUT_WEIGHT * done


def _opens(r: Request, never_sent: Collection[str]) -> bool:
    """``r`` was sent on its own schedule: it starts an interaction or has none (a later call
    is sent when the previous one answers, so it trails the backlog, not the load)."""
    return r.request_id not in never_sent and not r.metadata.interaction_stage


def _weighted_by(r: Request, until: float) -> float:
    """FairServe's weighted tokens of ``r`` computed by ``until``: its prompt once its first
    token came, and each output token by its time."""
    prefilled = r.first_token_time is not None and r.first_token_time <= until
    return _weighted(r, prefilled, sum(t <= until for t in r.token_times))


def _set_fair_shares(users: Sequence[_User]) -> None:
    """Max-min fair shares of the service the users got in the load period: water-filling,
    the smallest demands met in full first, the rest split evenly among the others."""
    left = sum(u.in_load for u in users)
    pending = sorted(users, key=lambda u: u.demand)
    for k, u in enumerate(pending):
        u.fair_share = min(u.demand, left / (len(pending) - k))
        left -= u.fair_share


def _expected_tokens(requests: Sequence[Request]) -> dict[tuple[str, int | None], float]:
    """Mean weighted tokens the calls of each (app, stage) ask for: FairServe's w_aj."""
    asked: dict[tuple[str, int | None], list[float]] = defaultdict(list)
    for r in requests:
        key = (r.metadata.app, r.metadata.interaction_stage)
        asked[key].append(_weighted(r, output=r.params.max_tokens))
    return {k: max(mean(v), 1.0) for k, v in asked.items()}


def _share(count: int, total: int) -> float:
    return count / total if total else math.nan


BENIGN_FIGURES = ("benign_delayed", "benign_share", "worst_benign_share")


def benign_figures(by_tenant: dict[str, dict[str, Any]]) -> dict[str, float]:
    """The benign users' figures of the module doc, from ``fairness(...)["by_tenant"]``;
    nan where no benign user sent anything."""
    rows = [
        row
        for name, row in by_tenant.items()
        if not name.startswith("abuser") and row["requests"] > row["abandoned"]
    ]
    owed = sum(row["fair_share"] for row in rows)
    shares = [row["share_received"] for row in rows if not math.isnan(row["share_received"])]
    return {
        "benign_delayed": _share(sum(row["delayed"] for row in rows), len(rows)),
        "benign_share": sum(row["service_in_load"] for row in rows) / owed if owed else math.nan,
        "worst_benign_share": min(shares, default=math.nan),
    }
