"""Layer safepoints inside a forward pass: where a step of preemptible work may stop.

The runner hands a model ``Safepoints`` only for a step the scheduler marked preemptible
(``SchedulerOutput.abort``); the model walks its decoder layers through ``walk_layers``, which
calls ``check`` before the first layer and after every ``interval`` layers. ``check`` raises to
stop the pass. A step without safepoints walks the plain ``enumerate(layers)``, so it pays
nothing per layer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True, slots=True)
class Safepoints:
    """Check before the first layer and after every ``interval`` layers;
    ``check(layers_done)`` raises to stop."""

    interval: int
    check: Callable[[int], None]

    def __post_init__(self) -> None:
        if self.interval < 1:
            raise ValueError(f"safepoint interval must be >= 1, got {self.interval}")


def walk_layers(
    layers: nn.ModuleList, safepoints: Safepoints | None
) -> Iterator[tuple[int, nn.Module]]:
    """``(index, layer)`` in order, with the safepoints' checks between layers."""
    if safepoints is None:
        return enumerate(layers)
    return _checked(layers, safepoints)


def _checked(layers: nn.ModuleList, safepoints: Safepoints) -> Iterator[tuple[int, nn.Module]]:
    # NOTE: the generator resumes after the caller has run layer i, so ``done`` layers are
    # complete when ``check`` runs. One before the first layer: a signal raised before the
    # step (a request that arrived while it was scheduled) stops it having computed nothing.
    # None after the last layer: finishing costs less than the step that would redo it.
    last, every = len(layers), safepoints.interval
    safepoints.check(0)
    for i, layer in enumerate(layers):
        yield i, layer
        done = i + 1
        if done % every == 0 and done < last:
            safepoints.check(done)
