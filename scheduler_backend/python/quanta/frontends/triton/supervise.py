"""How ``quanta serve`` keeps its tritonserver: restarted when it dies, drained when stopped.

The drain itself is coordinated with the model instances in ``quanta.frontends.triton.drain``;
this is the serve side: the messages, the backoff and the limits.
"""

from __future__ import annotations

import time
from typing import Any

import typer


def drain(server: Any, timeout: float) -> None:
    """Refuse new requests, give in-flight ones ``timeout`` seconds, end the rest clearly;
    a second Ctrl-C stops at once."""
    try:
        drained = server.drain(
            timeout,
            announce=lambda: typer.echo(
                f"\ndraining: new requests are refused, in-flight ones get {timeout:g} s "
                "(Ctrl-C again to stop now) ..."
            ),
        )
        if drained:
            typer.echo("drained")
        else:
            typer.echo("drain did not finish in time; stopping anyway", err=True)
    except KeyboardInterrupt:
        typer.echo("stopping now")


HEALTHY_S = 300.0  # a server up this long has recovered: its restarts no longer count
BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0)


def supervise(server: Any, max_restarts: int, ready_timeout: float) -> int:
    """Wait for the server; restart it when it dies, with backoff, until it has died
    ``max_restarts`` times in a row. Returns its exit code when it stops for good.

    Why: tritonserver 2.51 aborts on some streams of gRPC errors from clients (see the
    README's "When tritonserver dies"); the clients, the OpenAI gateway and the ports
    outlive it, so a restart on the same ports is all they need.
    """
    from quanta.frontends.triton.launcher import LaunchError

    in_a_row = 0
    while True:
        started = time.monotonic()
        code = server.wait()
        if code == 0:  # it was shut down, not killed: nothing to recover from
            return 0
        if time.monotonic() - started >= HEALTHY_S:
            in_a_row = 0
        status = server.exit_status()
        tail = "\n".join(f"  | {line}" for line in server.log_tail(25))
        if in_a_row >= max_restarts:
            typer.echo(
                f"tritonserver died ({status}) and was restarted {in_a_row} time(s) in a row "
                f"(--max-restarts {max_restarts}); giving up. Its last lines:\n{tail}",
                err=True,
            )
            return code or 1
        delay = BACKOFF_S[min(in_a_row, len(BACKOFF_S) - 1)]
        in_a_row += 1
        typer.echo(
            f"tritonserver died ({status}); restart {in_a_row}/{max_restarts} in {delay:.0f}s. "
            f"Its last lines:\n{tail}",
            err=True,
        )
        time.sleep(delay)
        try:
            server.restart()
            server.wait_ready(ready_timeout)
        except LaunchError as exc:
            typer.echo(f"restart failed: {exc}", err=True)
            continue
        typer.echo(f"ready again after restart {server.restarts}")
