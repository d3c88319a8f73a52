"""FairServe's figures of a live run (``quanta bench serve``): the simulator's ``fairness``,
fed with what the client saw.

Why an adapter rather than a second implementation: the definitions (answered interactions,
wasted tokens, delayed and served users, Jain's index over weighted service) must mean the
same thing in a simulated and a live run, so each ``ClientResult`` is turned into the core
``Request`` that ``quanta.sim.fairness.fairness`` reads, with the workload row's metadata.

What a live run cannot see, and what stands in for it:

- *Queueing* (first scheduled - sent) is not visible to a client: the time to the first
  streamed token (TTFT, network and prefill included) stands in for it, so
  ``delayed_users_fraction`` counts users with a call whose TTFT exceeded the threshold.
- *Throttled* calls are those whose error names ``[resource_exhausted]`` (the server's
  throttle, on every protocol); *abandoned* calls are those the client never sent because an
  earlier call of their interaction failed.
- A prompt counts as computed once a token streamed back; the lengths are the server's
  reported prompt length, else the row's. Output tokens are spread over the chunks that
  carried them, in order (a chunk's time stands for each of its tokens'), which is what the
  service received by a time (against the fair share) reads.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from quanta.bench.client import ClientResult
    from quanta.core.request import Request
    from quanta.workloads import WorkloadRequest


def live_fairness(
    rows: Sequence[WorkloadRequest],
    results: Sequence[ClientResult],
    *,
    delay_threshold_s: float = 2.0,
) -> dict[str, Any]:
    """``quanta.sim.fairness.fairness`` of a replay of ``rows`` that gave ``results`` (one per
    row, matched by request id); see the module doc for the live stand-ins."""
    from quanta.sim.fairness import fairness

    by_id = {r.request_id: r for r in results}
    requests = [_request(row, by_id[row.request_id]) for row in rows]
    throttled = {r.request_id for r in results if r.throttled}
    abandoned = {r.request_id for r in results if r.abandoned}
    return fairness(requests, throttled, abandoned, delay_threshold_s=delay_threshold_s)


def _request(row: WorkloadRequest, result: ClientResult) -> Request:
    """The core request that ``fairness`` reads: lengths, metadata, and the client's times."""
    from quanta.core.request import Request, RequestMetadata, SamplingParams

    prompt = result.num_prompt_tokens or row.prompt_tokens
    request = Request(
        row.request_id,
        [1] * prompt,
        SamplingParams(max_tokens=row.output_tokens, ignore_eos=True, temperature=0.0),
        result.scheduled_s if math.isnan(result.send_s) else result.send_s,  # NaN: never sent
        seed=0,
        metadata=RequestMetadata(**row.metadata()),
        output_token_ids=[0] * result.num_output_tokens,
        error=result.error,
    )
    if result.chunk_s:
        # NOTE: TTFT stands in for queueing (module doc).
        request.first_scheduled_time = request.first_token_time = result.chunk_s[0]
        n, chunks = result.num_output_tokens, result.chunk_s
        request.token_times = [chunks[k * len(chunks) // n] for k in range(n)]
    if not result.abandoned:
        request.finish_time = result.end_s
    return request
