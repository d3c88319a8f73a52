"""How ``quanta serve`` keeps its tritonserver: restarted when it dies, drained when stopped.

The drain itself is coordinated with the model instances in ``quanta.frontends.triton.drain``;
this is the serve side: the messages, the backoff and the limits.
"""

from __future__ import annotations

import threading
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


def supervise_all(servers: list[Any], max_restarts: int, ready_timeout: float) -> int:
    """``supervise`` each server on a thread of its own; returns when every one has stopped
    for good, with the first non-zero exit code (a replica that gives up leaves the others
    serving). The main thread only waits, so Ctrl-C still reaches it."""
    if len(servers) == 1:
        return supervise(servers[0], max_restarts, ready_timeout)
    codes = [0] * len(servers)

    def run(i: int) -> None:
        codes[i] = supervise(servers[i], max_restarts, ready_timeout)

    threads = [
        threading.Thread(target=run, args=(i,), name=f"supervise-{i}", daemon=True)
        for i in range(len(servers))
    ]
    for t in threads:
        t.start()
    for t in threads:
        while t.is_alive():
            t.join(0.5)  # NOTE: a bounded join keeps the main thread interruptible
    return next((c for c in codes if c != 0), 0)


def drain_all(servers: list[Any], timeout: float) -> None:
    """Drain every replica at once (each refuses new requests at the same moment), within
    one ``timeout``."""
    if len(servers) == 1:
        drain(servers[0], timeout)
        return
    threads = [threading.Thread(target=drain, args=(s, timeout), daemon=True) for s in servers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 30)
