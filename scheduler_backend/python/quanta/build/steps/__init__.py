"""Engine build steps behind ``quanta build``, one module per model family (and device).

Each module here lists its builders in ``BUILDERS`` (``opt.py``, ``llama.py``); they are found
by scanning this package, so a new family, or a GPU builder for an existing one, is a module
added here and neither the CLI, the build driver nor the family's spec changes. When two
builders claim the same (family, device), the one with the higher ``priority`` wins.
"""

from __future__ import annotations

import importlib
import pkgutil

from quanta.build.steps.base import BuildError, FamilyBuilder

__all__ = ["BuildError", "FamilyBuilder", "builder_for", "builders"]


def builders() -> list[FamilyBuilder]:
    """Every builder the modules of this package list."""
    found: list[FamilyBuilder] = []
    for info in pkgutil.iter_modules(__path__):
        if info.name == "base" or info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        found.extend(getattr(module, "BUILDERS", ()))
    return found


def builder_for(family: str, device: str) -> FamilyBuilder:
    """The builder for a model family on a device kind (``cpu`` or ``cuda``)."""
    matching = [b for b in builders() if b.family == family and device in b.devices]
    if not matching:
        known = sorted({f"{b.family}/{d}" for b in builders() for d in b.devices})
        raise BuildError(f"no engine builder for {family} on {device}; builders: {known}")
    return max(matching, key=lambda b: b.priority)
