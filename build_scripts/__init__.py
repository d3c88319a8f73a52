"""Engine build steps behind ``quanta build``, one module per model family (and device).

Each family's spec (``quanta.families``) names its default ``FamilyBuilder`` (``opt.py``,
``llama.py`` here). A module here may add builders in a ``BUILDERS`` list, a GPU builder for
an existing family say; they are found by scanning this package, so neither the CLI nor the
build driver changes. When two builders claim the same (family, device), the one with the
higher ``priority`` wins.
"""

from __future__ import annotations

import importlib
import pkgutil

from quanta.families import FAMILIES

from build_scripts.base import BuildError, FamilyBuilder

__all__ = ["BuildError", "FamilyBuilder", "builder_for", "builders"]


def builders() -> list[FamilyBuilder]:
    """Each family's default builder, then every builder the modules of this package add."""
    found = [_default_builder(spec.builder_class()) for spec in FAMILIES.values()]
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


def _default_builder(cls: type) -> FamilyBuilder:
    """An instance of the class a spec names, refused early if it is not a builder."""
    if not issubclass(cls, FamilyBuilder):
        raise TypeError(f"{cls.__module__}.{cls.__name__} is not a FamilyBuilder")
    return cls()
