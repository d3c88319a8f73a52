"""Apt-Serve's hybrid-cache knapsack (§4.3) as a pure function: which candidates run, with a
KV or a hidden cache, within a memory limit, by the greedy on value per block whose result is
worth at least half the optimum. ``AdaptivePacker`` feeds it each step; tests brute-force it.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable, Sequence
from operator import attrgetter
from typing import NamedTuple, TypeVar

from quanta.core.request import CacheKind

# Seconds: what a request past its SLO is worth with fallback "zero", and the least any option
# is worth, so that work which fits is never left idle.
NEAR_ZERO = 1e-9

K = TypeVar("K")  # what names an item to the walk: an index, or a key of the caller's
Alone = tuple[float, K, CacheKind]  # an option taken on its own: (its value, item, kind)


class Item(NamedTuple):
    """One knapsack candidate: what running it is worth and what each kind of cache costs.

    A named tuple: a step makes one per waiting request, and a frozen dataclass took three
    times as long to build."""

    value: float  # p: the pending seconds its run clears (after the SLO fallback)
    kv_blocks: int  # m >= 1: its cache as K and V, the KV option's weight
    hidden_blocks: int  # >= 1: its cache as hidden states (about m / 2), the hidden option's
    kv: bool = True  # the KV option is open to it
    hidden: bool = True  # the hidden option is open to it
    tokens: int = 1  # this step's tokens of it
    # Steps the hidden option commits it to: its recompute is charged once per step. 1 when
    # the choice is this step's alone; more when choosing hidden fixes its cache kind for
    # the steps ahead (``AdaptivePacker`` never switches a hidden cache back in place).
    hidden_steps: float = 1.0


_tokens = attrgetter("tokens")


def options(item: Item, factor: float, memory: int) -> list[tuple[CacheKind, int, float]]:
    """The item's useful options as (kind, blocks, value), lightest first.

    Hidden is worth ``value - factor * kv_blocks * hidden_steps``; options heavier than
    ``memory`` are gone, and so is hidden when it is worth nothing while KV is open. Beside
    KV, hidden stays only when its value per block is at least what the upgrade to KV adds
    per block (the options' upper hull): with exactly half the blocks, hidden worth at least
    half of KV, Apt-Serve's public rule. The greedy then takes hidden before the upgrade and
    is the LP relaxation's greedy, which the factor-2 bound rests on.
    """
    value = max(item.value, NEAR_ZERO)
    hidden_value = item.value - factor * item.kv_blocks * item.hidden_steps
    w_h, w_k = item.hidden_blocks, item.kv_blocks
    kv = item.kv and w_k <= memory
    hidden = item.hidden and w_h <= memory and (hidden_value > 0 or not item.kv)
    if kv and hidden:
        hidden = w_h < w_k and hidden_value * (w_k - w_h) >= (value - hidden_value) * w_h
    out: list[tuple[CacheKind, int, float]] = []
    if hidden:
        out.append((CacheKind.HIDDEN, w_h, max(hidden_value, NEAR_ZERO)))
    if kv:
        out.append((CacheKind.KV, w_k, value))
    return out


def greedy_knapsack(
    items: Sequence[Item],
    memory: int,
    factor: float,
    *,
    seats: int | None = None,
    tokens: int | None = None,
    chunked: bool = False,
    bounds: tuple[list[float], list[float]] | None = None,
) -> dict[int, CacheKind]:
    """Apt-Serve's greedy: the chosen items (indices) and their cache, in the order taken.

    Each item's options become increments (hidden: 0 -> hidden blocks; upgrade: hidden -> KV
    blocks; or 0 -> KV alone), taken by value gained per block, highest first, items earlier
    in ``items`` first on ties; one that does not fit is skipped and the walk goes on. When one
    option alone is worth more than the whole walk it is taken instead, so the result is worth
    at least half the optimum of  max sum g  s.t. sum blocks <= ``memory``. ``seats`` and
    ``tokens`` (the step's limits) are kept too, without that bound; with ``chunked`` an item
    may take fewer tokens than it asks. ``factor`` is (|W| + |R|) * rho. ``bounds`` is
    ``item_bounds(items, factor)`` when the caller worked it out already (a packer that
    builds the items one by one can count them as it goes, in the same pass).
    """
    worth, bound = item_bounds(items, factor) if bounds is None else bounds
    order = sorted(range(len(items)), key=bound.__getitem__)

    def alone(capacity: int, seats: int | None, tokens: int | None) -> Alone | None:
        return best_alone(enumerate(items), factor, capacity, seats, tokens, chunked)

    return greedy_walk(
        ((bound[i], i, items[i]) for i in order),
        memory,
        factor,
        seats=seats,
        tokens=tokens,
        chunked=chunked,
        least=min(map(_tokens, items), default=0),
        most=max(worth, default=0.0),
        alone=alone,
    )


def greedy_walk(
    source: Iterable[tuple[float, K, Item]],
    memory: int,
    factor: float,
    *,
    seats: int | None,
    tokens: int | None,
    chunked: bool,
    least: int,
    most: float,
    alone: Callable[[int, int | None, int | None], Alone[K] | None],
) -> dict[K, CacheKind]:
    """``greedy_knapsack`` over items named by keys of any order: ``source`` gives each
    item with its bound (``item_bounds``) and key, by (bound, key); ``least`` is the fewest
    tokens any item asks, ``most`` the most any is worth, and ``alone(memory, seats,
    tokens)`` the option worth most on its own (``best_alone``). A caller that keeps its
    items in that order across steps passes them lazily and is read only as far as the walk
    goes."""
    # NOTE: with a long queue most items are never reached: the walk fills the step's seats
    # and tokens from the first few increments, and ends once nothing further could be taken
    # (no seat or token left for a new item, and no upgrade of a chosen item still ahead).
    # So the increments are walked from a heap, and an item's options are only weighed once
    # the walk comes near it: items wait in the order of a bound on what any increment of
    # theirs gains per block, and join the heap while that bound reaches its top.
    # NOTE: once no seat or token is left for a new item, an item not yet reached could only
    # be passed over, so the source is read no further; the chosen items' upgrades still
    # ahead are walked on in their order
    source = iter(source)
    ahead = next(source, None)
    room = True
    seen: dict[K, Item] = {}
    opts: dict[K, list[tuple[CacheKind, int, float]]] = {}
    steps: list[tuple[float, K, int, int, float]] = []
    capacity, first_seats, first_tokens = memory, seats, tokens
    chosen: dict[K, CacheKind] = {}
    upgrades = 0  # chosen items whose upgrade to KV is still ahead in the walk
    total = 0.0
    while True:
        # NOTE: an item's increments come after (its bound, its key) in the walk's order,
        # and so do every later item's: read on only while that could come before the top
        while room and ahead is not None and (not steps or ahead[:2] < steps[0][:2]):
            _, i, item = ahead
            ahead = next(source, None)
            seen[i] = item
            opts[i] = choices = options(item, factor, capacity)
            prev_w, prev_v = 0, 0.0
            for stage, (_, w, v) in enumerate(choices):
                step = (-(v - prev_v) / (w - prev_w), i, stage, w - prev_w, v - prev_v)
                heapq.heappush(steps, step)
                prev_w, prev_v = w, v
        if not steps:
            break
        _, i, stage, dw, dv = heapq.heappop(steps)
        if stage == 1 and i in chosen:
            upgrades -= 1
        if dw <= memory:
            if stage == 0:
                item = seen[i]
                if _has_room(item, seats, tokens, chunked):
                    seats = None if seats is None else seats - 1
                    tokens = None if tokens is None else tokens - min(item.tokens, tokens)
                    chosen[i] = opts[i][0][0]
                    upgrades += len(opts[i]) - 1
                    memory -= dw
                    total += dv
            elif i in chosen:
                chosen[i] = opts[i][stage][0]
                memory -= dw
                total += dv
        room = _room_for_any(least, seats, tokens, chunked)
        if not upgrades and not room:
            break
    if most > total:  # NOTE: else no option alone is worth more
        best = alone(capacity, first_seats, first_tokens)
        if best is not None and best[0] > total:
            return {best[1]: best[2]}
    return chosen


def item_bounds(items: Sequence[Item], factor: float) -> tuple[list[float], list[float]]:
    """For each item, at least what any of its options is worth, and at most what any of
    its increments gains per block, negated (the heap's key): worth over the least weight of
    an increment it may have. Beside KV, hidden is an option only when it is worth something
    (``options``), so an item whose hidden is worth nothing has the KV increment alone."""
    worth: list[float] = []
    bounds: list[float] = []
    for value, w_k, w_h, kv, hidden, _, steps in items:
        hidden_value = value - factor * w_k * steps
        most = max(value, hidden_value, NEAR_ZERO)  # NOTE: as ``options``
        least = w_k if kv and hidden_value <= 0 else lightest(w_k, w_h, kv, hidden)
        worth.append(most)
        bounds.append(-(most / least) if least > 0 else -math.inf)
    return worth, bounds


def lightest(kv_blocks: int, hidden_blocks: int, kv: bool, hidden: bool) -> int:
    """The least weight of the increments an item may have, whatever its value: the KV
    option's, the hidden option's, or the upgrade's from hidden to KV, of those open to it
    (``item_bounds`` divides by it)."""
    if not kv:
        return hidden_blocks
    if not hidden:
        return kv_blocks
    if kv_blocks > hidden_blocks:
        return min(kv_blocks, hidden_blocks, kv_blocks - hidden_blocks)
    return min(kv_blocks, hidden_blocks)


def best_alone(
    items: Iterable[tuple[K, Item]],
    factor: float,
    memory: int,
    seats: int | None,
    tokens: int | None,
    chunked: bool,
) -> Alone[K] | None:
    """The option worth most on its own, among the ``(key, item)`` pairs that have room
    (the first such item, and its lightest such option, on ties): the greedy's other
    candidate."""
    best: Alone[K] | None = None
    for i, item in items:
        if not _has_room(item, seats, tokens, chunked):
            continue
        for kind, _, v in options(item, factor, memory):
            if best is None or v > best[0]:
                best = (v, i, kind)
    return best


def _has_room(item: Item, seats: int | None, tokens: int | None, chunked: bool) -> bool:
    """A seat is left, and the item's tokens (or, chunked, some of them)."""
    return _room_for_any(item.tokens, seats, tokens, chunked)


def _room_for_any(least: int, seats: int | None, tokens: int | None, chunked: bool) -> bool:
    """A seat is left, and tokens for an item that asks for ``least`` (or, chunked, some)."""
    seat = seats is None or seats > 0
    return seat and (tokens is None or least <= tokens or (chunked and tokens > 0))
