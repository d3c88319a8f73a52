"""The lab's commands, attached to the ``quanta`` CLI through the ``quanta.commands`` entry
point (pyproject.toml), so the serving package never imports the lab.

``register`` puts each command where it always was: ``simulate repro`` and ``validate`` into
the ``simulate`` group, the lab's benchmarks into ``bench``, and ``quanta profile`` at the top.
Every command imports its measurement inside itself, so ``quanta --help`` stays fast.
"""

from __future__ import annotations

import typer


def _group(app: typer.Typer, name: str) -> typer.Typer:
    """The sub-command group ``name`` the serving CLI built (``simulate``, ``bench``)."""
    for info in app.registered_groups:
        if info.name == name and info.typer_instance is not None:
            return info.typer_instance
    raise LookupError(f"the quanta CLI has no {name!r} group to add the lab's commands to")


def register(app: typer.Typer) -> None:
    """Add the lab's commands to the ``quanta`` app (called by ``quanta.cli`` at import)."""
    from quanta_lab.bench import (
        cli,
        gpu_cli,
        prefix_prefill_cli,
        quality_cli,
        safepoints,
        speculative_cli,
        structured_cli,
    )
    from quanta_lab.bench.peer import cli as peer_cli
    from quanta_lab.sim import cli as sim_cli

    bench_app = _group(app, "bench")
    cli.register(app, bench_app)
    peer_cli.register(app, bench_app)
    sim_cli.register(app, _group(app, "simulate"), bench_app)
    for module in (
        safepoints,
        quality_cli,
        structured_cli,
        speculative_cli,
        prefix_prefill_cli,
        gpu_cli,
    ):
        module.register(app, bench_app)
