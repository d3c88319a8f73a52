"""Synthetic prompt token ids for workload rows that carry a length but no text: distinct
across unrelated requests, identical exactly where the workload says prompts share a prefix.

Why it matters: with prefix caching, what a run reuses is decided by the prompt ids alone, so
a trace replayed as one constant token (or as ids from one shared seed) would share far more
than real traffic, and one replayed with per-request random ids would share nothing. Every
tool that turns a row into ids (the simulator, ``quanta bench serve``, Locust) goes through
``PromptIds``, so a simulated run and a live one send the same prompts.

The scheme, for a row of ``prompt_tokens`` tokens (all ids in ``[lo, hi)``):

- ``prompt_token_ids`` given: those ids, as they are (a trace's real ids; the range is not
  applied).
- Position ``p < prefix_tokens``: the ``p``-th id of its ``prefix_group``'s stream, a seeded
  sequence that depends only on the group's name (and the seed). Two requests of one group
  therefore share exactly their first min(``prefix_tokens``) ids.
- A group named ``parent/child`` (split at the first ``/``) takes its first ``system_tokens``
  positions from the stream of ``parent`` instead: every conversation ``app/c1``,
  ``app/c2``... of an app starts with the system prompt of ``app``, which is also what
  requests grouped under ``app`` itself (an agent app's calls) share.
- Positions from ``prefix_tokens`` on: the request's own stream, seeded by its request id
  (its index in the workload when it has none), so they share nothing beyond chance with
  any other request.

A stream continues past any one prompt: a conversation's next turn repeats the previous
prompt and its answer, so the synthetic answer of a grouped request is its group's stream
right after its prompt (``output_ids``); a real model's answer differs, which a replay that
sends the next turn as written does not see.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from quanta.workloads.model import WorkloadError, WorkloadRequest

DEFAULT_ID_RANGE = (4, 32000)  # ids of a model-less run: past the usual special tokens


class PromptIds:
    """The scheme of the module doc for one id range and seed.

    NOTE: group streams are memoised (the ``max_groups`` most recently used), so a workload
    whose requests share long prefixes draws each prefix once; the ids do not depend on what
    is memoised, only the time to make them.
    """

    def __init__(
        self,
        id_range: tuple[int, int] = DEFAULT_ID_RANGE,
        *,
        seed: int = 0,
        max_groups: int = 1024,
    ) -> None:
        lo, hi = id_range
        if not 0 <= lo < hi:
            raise WorkloadError(f"need a token id range 0 <= lo < hi, got {lo}:{hi}")
        if max_groups < 1:
            raise WorkloadError(f"max_groups must be >= 1, got {max_groups}")
        # NOTE: drawn from one tuple of ints, so the lists share their int objects: a long
        # synthetic trace costs a pointer per token, as a list of one constant did.
        self._pool = tuple(range(lo, hi))
        self._seed = seed
        self._max_groups = max_groups
        self._groups: dict[str, tuple[random.Random, list[int]]] = {}

    def of(self, request: WorkloadRequest, index: int = 0) -> list[int]:
        """The prompt ids of ``request``, the ``index``-th row of its workload."""
        if request.prompt_token_ids is not None:
            return list(request.prompt_token_ids)
        return self.ids(
            request.prompt_tokens,
            request.request_id or f"#{index}",
            prefix_group=request.prefix_group,
            prefix_tokens=request.prefix_tokens,
            system_tokens=request.system_tokens,
        )

    def ids(
        self,
        length: int,
        key: str,
        *,
        prefix_group: str | None = None,
        prefix_tokens: int = 0,
        system_tokens: int = 0,
    ) -> list[int]:
        """``length`` ids: the first ``prefix_tokens`` from the group, the rest from the
        stream of ``key`` (a request id): what ``of`` makes of a row's fields."""
        shared = min(prefix_tokens, length) if prefix_group is not None else 0
        head = self.group(prefix_group, 0, shared, system_tokens=system_tokens) if shared else []
        rng = random.Random(f"{self._seed}/request/{key}")
        return head + rng.choices(self._pool, k=length - shared)

    def output_ids(self, request: WorkloadRequest) -> list[int]:
        """The synthetic answer of a grouped request: its group's stream right after the
        prompt, so the next turn of a conversation, whose prefix covers prompt and answer,
        starts with exactly ``of(request) + output_ids(request)``."""
        if request.prefix_group is None:
            raise WorkloadError(f"request {request.request_id!r} has no prefix_group")
        start = request.prompt_tokens
        return self.group(
            request.prefix_group,
            start,
            start + request.output_tokens,
            system_tokens=request.system_tokens,
        )

    def group(self, name: str, start: int, stop: int, *, system_tokens: int = 0) -> list[int]:
        """Positions ``[start, stop)`` of group ``name``'s stream, its first
        ``system_tokens`` taken from its parent's (``parent/child``) when it has one."""
        parent, slash, _ = name.partition("/")
        split = min(max(system_tokens, start), stop) if slash else start
        head = self._stream(parent, split)[start:split] if split > start else []
        return head + self._stream(name, stop)[split:stop]

    def _stream(self, name: str, length: int) -> Sequence[int]:
        """At least ``length`` ids of group ``name``'s stream, drawn once and extended."""
        entry = self._groups.pop(name, None)
        if entry is None:
            entry = (random.Random(f"{self._seed}/group/{name}"), [])
            if len(self._groups) >= self._max_groups:
                del self._groups[next(iter(self._groups))]  # the least recently used
        self._groups[name] = entry
        rng, ids = entry
        if len(ids) < length:
            # NOTE: every draw takes one random(), so extending in any steps gives one stream
            ids += rng.choices(self._pool, k=length - len(ids))
        return ids


def prompt_ids(
    request: WorkloadRequest,
    index: int = 0,
    *,
    id_range: tuple[int, int] = DEFAULT_ID_RANGE,
    seed: int = 0,
) -> list[int]:
    """The ids of one row (``PromptIds(id_range, seed=seed).of(request, index)``); for many
    rows keep one ``PromptIds``, which draws a shared prefix once."""
    return PromptIds(id_range, seed=seed).of(request, index)
