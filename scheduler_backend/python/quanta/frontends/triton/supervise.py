"""How ``quanta serve`` keeps its tritonserver: restarted when it dies, drained when stopped.

The drain itself is coordinated with the model instances in ``quanta.frontends.triton.drain``;
this is the serve side: the messages, the backoff and the limits. What the supervisor knows
is published in ``quanta.frontends.triton.supervisor_state`` for the gateway to read.
"""

from __future__ import annotations

import random
import threading
import time
from typing import Any

import typer

from quanta.frontends.triton.supervisor_state import SupervisorState


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


HEALTHY_S = 300.0  # a server up this long has recovered: the backoff starts over
BASE_DELAY_S = 1.0  # the first restart's delay; each death in a row doubles it ...
MAX_DELAY_S = 30.0  # ... up to this (``--max-restart-delay``)


def backoff_delay(
    in_a_row: int, max_delay: float = MAX_DELAY_S, rng: random.Random | None = None
) -> float:
    """Seconds before restart ``in_a_row`` (1 for the first death in a row): capped
    exponential backoff, ``min(max_delay, 1 s * 2**(in_a_row-1))``, with "equal jitter"
    (uniform in its upper half) so replicas that died together do not reload together."""
    delay = min(max_delay, BASE_DELAY_S * 2.0 ** max(0, in_a_row - 1))
    return (rng or random).uniform(delay / 2, delay)


def supervise(
    server: Any,
    max_restarts: int,
    ready_timeout: float,
    *,
    max_delay: float = MAX_DELAY_S,
    state: SupervisorState | None = None,
) -> int:
    """Wait for the server; restart it whenever it dies, with capped exponential backoff.
    ``max_restarts`` 0 restarts forever; N gives up once it has died N+1 times in a row (a
    server up ``HEALTHY_S`` resets the count). Returns its exit code when it stops for good:
    0 when it was shut down, else the code it died with.

    Why forever by default: tritonserver 2.51 aborts on some streams of gRPC errors from
    clients (see the README's "When tritonserver dies"), so a limit hands whoever can reach
    its gRPC port a way to end the service. The clients, the OpenAI gateway and the ports
    outlive it, so a restart on the same ports is all they need; meanwhile ``state`` (the
    server's own by default) tells the gateway to answer 503 with Retry-After.
    """
    from quanta.frontends.triton.launcher import LaunchError

    state = state or server.state
    state.mark_up()  # NOTE: the caller waited for it to be ready
    limit = f"--max-restarts {max_restarts}" if max_restarts else "restarting until stopped"
    in_a_row = 0
    while True:
        started = time.monotonic()
        code = server.wait()
        if code == 0:  # it was shut down, not killed: nothing to recover from
            state.mark_stopped()
            return 0
        status = server.exit_status()
        tail = "\n".join(f"  | {line}" for line in server.log_tail(25))
        while True:  # until a restart becomes ready
            if time.monotonic() - started >= HEALTHY_S:
                in_a_row = 0
            if max_restarts and in_a_row >= max_restarts:
                state.mark_failed(status)
                typer.echo(
                    f"tritonserver died ({status}) and was restarted {in_a_row} time(s) in "
                    f"a row ({limit}); giving up. Its last lines:\n{tail}",
                    err=True,
                )
                return code or 1
            in_a_row += 1
            delay = backoff_delay(in_a_row, max_delay)
            state.mark_down(status, delay, in_a_row)
            typer.echo(
                f"tritonserver died ({status}); restart {state.restarts + 1} in {delay:.1f}s "
                f"(death {in_a_row} in a row; {limit}). Its last lines:\n{tail}",
                err=True,
            )
            time.sleep(delay)
            state.mark_restarting()
            began = time.monotonic()
            try:
                server.restart()
                server.wait_ready(ready_timeout)
            except LaunchError as exc:
                # NOTE: one that never became ready may still run: it counts as dead
                server.stop(remove_backend_dir=False)
                status, tail, code = f"restart {state.restarts} failed", "  | (above)", code or 1
                started = time.monotonic()
                typer.echo(f"restart {state.restarts} failed: {exc}", err=True)
                continue
            state.mark_up(time.monotonic() - began)
            typer.echo(f"ready again after restart {server.restarts}")
            break


def supervise_all(
    servers: list[Any], max_restarts: int, ready_timeout: float, max_delay: float = MAX_DELAY_S
) -> int:
    """``supervise`` each server on a thread of its own; returns when every one has stopped
    for good, with the first non-zero exit code (a replica that gives up leaves the others
    serving). The main thread only waits, so Ctrl-C still reaches it."""
    if len(servers) == 1:
        return supervise(servers[0], max_restarts, ready_timeout, max_delay=max_delay)
    codes = [0] * len(servers)

    def run(i: int) -> None:
        codes[i] = supervise(servers[i], max_restarts, ready_timeout, max_delay=max_delay)

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
