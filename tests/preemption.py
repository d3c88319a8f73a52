"""The same prompts through a roomy pool and through one so small that requests must be
preempted: the preemption-invariance tests compare the two."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import quanta


def roomy_and_cramped(
    model_dir: Path,
    prompts: list[Any],
    params: list[Any],
    *,
    host_blocks: int,
    device_blocks: int,
    **engine: Any,
) -> tuple[list[Any], list[Any]]:
    """(results with room to spare, results from a pool that forces preemption by swap, when
    ``host_blocks`` > 0, else by recompute); asserts the small pool did preempt and that every
    block went home. ``engine``: more ``quanta.LLM`` arguments for the small pool's engine
    (the roomy one runs the plain engine)."""
    roomy = quanta.LLM(str(model_dir), cache={"num_device_blocks": 64}).generate(prompts, params)
    small = quanta.LLM(
        str(model_dir),
        cache={"num_device_blocks": device_blocks, "num_host_blocks": host_blocks, "block_size": 4},
        scheduler={"max_num_batched_tokens": 16},
        **engine,
    )
    try:
        cramped = small.generate(prompts, params)
    finally:
        small.close()
    stats = small.engine.loop.stats()
    kind = "swap" if host_blocks else "recompute"
    count = stats.num_preemptions_swap if host_blocks else stats.num_preemptions_recompute
    assert count > 0, f"the small pool never forced a {kind}"
    small.engine.loop.blocks.check_integrity()
    assert small.engine.loop.blocks.all_free()
    return roomy, cramped
