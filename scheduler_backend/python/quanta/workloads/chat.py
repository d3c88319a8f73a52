"""Multi-turn chat: every turn of a conversation sends the whole conversation so far, so its
prompt repeats the previous turn's prompt and answer: the traffic a prefix cache serves best.

- Conversations start as a renewal process (Poisson for ``cv`` 1) and each picks an app by
  weight. ``rate`` is the workload's mean turns per second: conversations start at ``rate``
  divided by the mean turns of the conversations drawn.
- An app's system prompt (``ChatApp.system_tokens``) opens every conversation of it. The
  default catalogue (``chat_apps``) has 4 apps with seeded system prompts log-uniform in
  [40, 400] tokens (our choice, the range of the agents workload's).
- Turn 0's prompt is the system prompt and the first user message; turn k's is turn k-1's
  prompt, its answer and a new user message. User messages have ShareGPT's input lengths
  (``SHAREGPT_INPUT``), answers the Azure conversation trace's output lengths
  (``AZURE_CONV_OUTPUT``, CC BY 4.0; Patel et al., Splitwise, ISCA 2024). The trace has no
  conversation ids, so it cannot give user messages or turns; those are our choices.
- Turns per conversation are geometric with mean ``mean_turns`` (default 4, our choice); a
  conversation ends sooner when its next turn's prompt and answer would not fit ``max_len``.
  A first turn that does not fit is redrawn, then shrunk to fit.
- Before each later turn the user thinks (``think_time_s`` mean, exponential or log-normal
  with sigma 1), counted from the previous answer's end: ``think_time_s`` of the turn, whose
  ``arrival_time`` is a lower bound (as in the agents workload), when it would be sent if
  every turn took no time.

Each conversation is an interaction (``interaction_id`` ``c<k>``, ``interaction_stage`` the
turn, ``interaction_last`` on its last turn) and a prefix group ``<app>/c<k>`` whose first
``system_tokens`` are the app's system prompt (``quanta.workloads.prompts``). A turn's whole
prompt is the conversation's transcript, so ``prefix_tokens`` is its ``prompt_tokens``; the
group's stream continues with the turn's answer (``PromptIds.output_ids``), so the next
turn's first (prompt + answer) ids are this turn's prompt and its synthetic answer. A real
model answers with other ids, which a replay of the written turns does not see.

Every conversation draws from its own seeded stream, so the same seed gives the same
conversations at any rate (their times scale with it).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

from quanta.workloads.arrivals import arrival_stream
from quanta.workloads.lengths import AZURE_CONV_OUTPUT, SHAREGPT_INPUT, TokenCount
from quanta.workloads.model import WorkloadError, WorkloadRequest

CHAT = "chat"  # the workload's name beside the length DATASETS (``make_workload``)
ThinkDist = Literal["exponential", "lognormal"]
THINK_DISTS: tuple[ThinkDist, ...] = ("exponential", "lognormal")
THINK_SIGMA = 1.0  # of the log-normal think time
_TRIES = 20  # redraws of a first turn that does not fit max_len before it is shrunk to fit


@dataclass(frozen=True, slots=True)
class ChatApp:
    """An app users chat with: its system prompt opens each of its conversations."""

    name: str
    system_tokens: int = 0
    weight: float = 1.0  # share of the conversations

    def __post_init__(self) -> None:
        if "/" in self.name or self.system_tokens < 0 or not self.weight > 0:
            raise WorkloadError(
                f"chat app {self.name!r}: need a name without '/', system_tokens >= 0, weight > 0"
            )


def chat_apps(num_apps: int = 4, seed: int = 0) -> list[ChatApp]:
    """The seeded catalogue: ``chat0``... with system prompts log-uniform in [40, 400]."""
    rng = random.Random(f"{seed}-chat-apps")
    lo, hi = math.log(40), math.log(400)
    return [ChatApp(f"chat{k}", round(math.exp(rng.uniform(lo, hi)))) for k in range(num_apps)]


def chat(
    num_requests: int,
    rate: float,
    *,
    apps: Sequence[ChatApp] | None = None,
    mean_turns: float = 4.0,
    think_time_s: float = 5.0,
    think_dist: ThinkDist = "lognormal",
    user_tokens: TokenCount = SHAREGPT_INPUT,
    answer_tokens: TokenCount = AZURE_CONV_OUTPUT,
    seed: int = 0,
    cv: float = 1.0,
    max_len: int = 2048,
    id_prefix: str = "r",
) -> list[WorkloadRequest]:
    """``num_requests`` turns of conversations, ordered by ``arrival_time``.

    Conversations are taken in order of their start until their turns add up to
    ``num_requests``; the last one taken is cut short to fit (its last turn kept is marked
    ``interaction_last``). ``apps`` defaults to ``chat_apps(seed=seed)``.
    """
    apps = list(chat_apps(seed=seed) if apps is None else apps)
    _check(num_requests, rate, apps, mean_turns, think_time_s, think_dist, max_len)
    shape = _Shape(mean_turns, think_time_s, think_dist, user_tokens, answer_tokens, max_len)
    pick, weights = random.Random(f"{seed}-chat-pick"), [a.weight for a in apps]
    conversations: list[list[WorkloadRequest]] = []
    drawn = 0
    while drawn < num_requests:
        k = len(conversations)
        app = pick.choices(apps, weights)[0]
        turns = _conversation(f"c{k}", app, random.Random(f"{seed}-chat-c{k}"), shape)
        drawn += len(turns)
        conversations.append(turns)
    if not conversations:
        return []
    starts = arrival_stream(rate * len(conversations) / drawn, random.Random(f"{seed}-chat"), cv)
    calls: list[WorkloadRequest] = []
    for turns in conversations:
        t0 = next(starts)
        kept = turns[: num_requests - len(calls)]
        kept[-1] = replace(kept[-1], interaction_last=True)
        calls += [replace(c, arrival_time=t0 + c.arrival_time) for c in kept]
    calls.sort(key=lambda c: c.arrival_time)  # NOTE: stable: ties keep the drawing order
    return [replace(c, request_id=f"{id_prefix}{k}") for k, c in enumerate(calls)]


@dataclass(frozen=True, slots=True)
class _Shape:
    """What every conversation of one workload draws from."""

    mean_turns: float
    think_time_s: float
    think_dist: ThinkDist
    user_tokens: TokenCount
    answer_tokens: TokenCount
    max_len: int

    def turns(self, rng: random.Random) -> int:
        """Geometric on 1, 2, ... with mean ``mean_turns``."""
        if self.mean_turns == 1:
            return 1
        return 1 + int(math.log(1.0 - rng.random()) / math.log(1.0 - 1.0 / self.mean_turns))

    def think(self, rng: random.Random) -> float:
        if self.think_time_s == 0:
            return 0.0
        if self.think_dist == "exponential":
            return rng.expovariate(1.0 / self.think_time_s)
        return rng.lognormvariate(math.log(self.think_time_s) - THINK_SIGMA**2 / 2, THINK_SIGMA)


def _conversation(
    conversation: str, app: ChatApp, rng: random.Random, shape: _Shape
) -> list[WorkloadRequest]:
    """One conversation's turns, times relative to its start, none marked last."""
    group = f"{app.name}/{conversation}"
    history, offset = app.system_tokens, 0.0
    turns: list[WorkloadRequest] = []
    for stage in range(shape.turns(rng)):
        if stage == 0:
            n_user, n_answer = _first_turn(app, rng, shape)
            think = 0.0
        else:
            n_user, n_answer = shape.user_tokens.sample(rng), shape.answer_tokens.sample(rng)
            think = shape.think(rng)
            if history + n_user + n_answer > shape.max_len:
                break  # NOTE: the conversation outgrew the model's context: it ends here
        offset += think
        prompt = history + n_user
        turns.append(
            WorkloadRequest(
                offset,
                prompt,
                n_answer,
                app=app.name,
                interaction_id=conversation,
                interaction_stage=stage,
                system_tokens=app.system_tokens,
                think_time_s=think,
                prefix_group=group,
                prefix_tokens=prompt,
            )
        )
        history = prompt + n_answer
    return turns


def _first_turn(app: ChatApp, rng: random.Random, shape: _Shape) -> tuple[int, int]:
    """(user, answer) tokens of a first turn, fitting ``max_len`` after the system prompt."""
    room = shape.max_len - app.system_tokens
    for _ in range(_TRIES):
        n_user, n_answer = shape.user_tokens.sample(rng), shape.answer_tokens.sample(rng)
        if n_user + n_answer <= room:
            return n_user, n_answer
    scale = room / (n_user + n_answer)  # NOTE: rare; only a small max_len reaches it
    n_user = max(1, int(n_user * scale))
    return n_user, max(1, min(room - n_user, int(n_answer * scale)))


def _check(
    num_requests: int,
    rate: float,
    apps: Sequence[ChatApp],
    mean_turns: float,
    think_time_s: float,
    think_dist: str,
    max_len: int,
) -> None:
    if num_requests < 0 or not apps:
        raise WorkloadError("need num_requests >= 0 and at least one app")
    if not rate > 0 or not mean_turns >= 1:
        raise WorkloadError(f"need rate > 0 and mean_turns >= 1, got {rate}, {mean_turns}")
    if not (math.isfinite(think_time_s) and think_time_s >= 0) or think_dist not in THINK_DISTS:
        raise WorkloadError(
            f"need a finite think_time_s >= 0 and think_dist in {THINK_DISTS}, got "
            f"{think_time_s}, {think_dist!r}"
        )
    too_long = [a.name for a in apps if a.system_tokens + 2 > max_len]
    if too_long:
        raise WorkloadError(
            f"max_len {max_len} leaves no room for a turn after the system prompt of {too_long}"
        )
