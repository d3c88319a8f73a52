"""A reserve of KV blocks for users within their share of the device pool.

A fair order decides who runs first, but a call that is not resident can start only in free
blocks. When one user floods the server, its admitted calls keep the pool full, and a benign
call that arrives waits for running calls to finish, however high it ranks
(docs/results/fairserve.md, "Delayed users"). So a call whose user already holds more than an equal
share of the pool (the pool over the users with live calls) starts only while the free
blocks left after it stay above ``fraction`` of the pool; users within their share may use
the reserve. Nothing is evicted and nothing is refused: a held-back call waits in the queue
and starts once the pool has room beyond the reserve, or once its user is within its share.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from quanta.core.plan import PoolView
from quanta.core.request import Request, RequestStatus


def hold_back(order: Sequence[Request], pool: PoolView, fraction: float) -> list[Request]:
    """``order`` without the calls the reserve holds back this step.

    Calls are taken in rank order as the packer would take them: each that is let through is
    counted against the free blocks and its user's holding, so two calls of one user cannot
    both pass on the same free blocks.
    """
    if fraction <= 0 or not order:
        return list(order)
    holding: dict[str, int] = defaultdict(int)
    for r in order:
        if r.status is RequestStatus.RUNNING:
            holding[r.metadata.tenant] += pool.num_blocks(r.request_id)
    users = {r.metadata.tenant for r in order}
    share = pool.total_device / len(users)
    reserve = fraction * pool.total_device
    free = pool.free_device
    kept: list[Request] = []
    for r in order:
        if r.status is RequestStatus.RUNNING:
            kept.append(r)
            continue
        user = r.metadata.tenant
        need = pool.blocks_for(r.num_tokens)
        if holding[user] > share and free - need < reserve:
            continue
        kept.append(r)
        free -= need
        holding[user] += need
    return kept
