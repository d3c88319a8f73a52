"""The read-only snapshot a policy decides from."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from quanta.core.blocks import BlockManager, Tier
from quanta.core.request import Request, RequestStatus


@dataclass(frozen=True, slots=True)
class SchedulerView:
    """Read-only snapshot handed to a policy. NOTE: policies must not mutate the requests."""

    now: float
    waiting: Sequence[Request]
    running: Sequence[Request]
    swapped: Sequence[Request]
    blocks: BlockManager = field(repr=False)

    @property
    def block_size(self) -> int:
        return self.blocks.block_size

    @property
    def free_device_blocks(self) -> int:
        return self.blocks.num_free(Tier.DEVICE)

    @property
    def free_host_blocks(self) -> int:
        return self.blocks.num_free(Tier.HOST)

    @property
    def total_device_blocks(self) -> int:
        return self.blocks.num_total(Tier.DEVICE)

    def num_blocks(self, request: Request) -> int:
        """Blocks the request holds now, in whichever tier its KV is."""
        return self.blocks.num_blocks(request.request_id)

    def blocks_to_grow(self, request: Request, num_new_tokens: int) -> int:
        """Device blocks the request needs to compute ``num_new_tokens`` more tokens.

        For a swapped request this includes bringing its host blocks back.
        """
        target = request.num_computed_tokens + num_new_tokens
        held = self.num_blocks(request) if request.status is RequestStatus.RUNNING else 0
        return max(0, self.blocks.blocks_for(target) - held)
