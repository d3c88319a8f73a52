"""The driver's side of a tensor-parallel group: worker processes, their start, each step's
hand-over, and what happens when one dies.

As in vLLM's multiprocessing executor, the engine process is rank 0: the scheduler and the
policies run there once, and each step's block work (a torch-free ``WorkerStep``) goes to
every worker over a pipe before rank 0 starts its own share. The ranks then meet only in
collectives (gloo on CPU), which also keep them in lockstep. Pipes carry the steps, not a
collective, because a server can sit idle for hours and a collective would time out.

A worker that dies takes its KV shards with it: the step's collective fails on rank 0 (gloo
notices the closed connection), the group is torn down, ``WorkerLostError`` fails every
request whose KV lived on it, and the next step starts a fresh set of workers.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection, Listener
from typing import Any

import torch
import torch.distributed as dist

from quanta.core.errors import WorkerLostError
from quanta.core.safepoint import StepAborted
from quanta.runner.tensor_parallel.collectives import end_exchanges

log = logging.getLogger(__name__)

# The interpreter workers run under. Inside Triton's Python stub ``sys.executable`` is not a
# Python, so the launcher names the one it runs (``quanta.frontends.triton.launcher``).
PYTHON_ENV = "QUANTA_PYTHON"
_WORKER = "quanta.runner.tensor_parallel.worker"
AUTH_ENV = "QUANTA_TP_AUTHKEY"  # the listener's key, kept off the command line
# A collective waits this long for a rank that neither answers nor hangs up.
COLLECTIVE_TIMEOUT_S = 120.0
# Loading a shard: the whole checkpoint is read, then cut.
READY_TIMEOUT_S = 600.0


@dataclass(frozen=True, slots=True)
class WorkerStep:
    """What a worker needs of one ``SchedulerOutput``: the tokens and block tables to run,
    the block copies, and whether the step may stop at a safepoint."""

    seqs: tuple[tuple[tuple[int, ...], int, tuple[int, ...], bool, int], ...]  # tokens,
    # start, block table, hidden cache, prompt length
    swap_out: tuple[tuple[int, int], ...]
    swap_in: tuple[tuple[int, int], ...]
    checkpoint: tuple[tuple[int, int], ...]
    preemptible: bool


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class WorkerGroup:
    """Ranks 1..world-1 of one runner, and rank 0's membership of their process group."""

    def __init__(self, world: int, runner_args: dict[str, Any], threads: int) -> None:
        self.world = world
        self.runner_args = runner_args
        self.threads = threads
        self.restarts = 0  # fresh sets of workers after a loss
        self._procs: list[subprocess.Popen[bytes]] = []  # rank r at index r - 1
        self._conns: list[tuple[int, Connection]] = []  # (rank, pipe), by rank
        self._connected = False

    # -- start and stop ----------------------------------------------------------------------
    def spawn(self) -> None:
        """Start the workers; each loads and cuts its shard while rank 0 loads its own.

        Each is a fresh interpreter running ``python -m quanta.runner.tensor_parallel.worker``
        (not multiprocessing's spawn, which re-imports the caller's ``__main__``) that dials
        back to a local listener; the pipe it gets carries its arguments and its steps.
        """
        self._init = f"tcp://127.0.0.1:{_free_port()}"
        if sys.platform.startswith("linux"):
            # NOTE: every rank is on this machine; gloo would otherwise pair them over the
            # address the hostname resolves to, which a sandbox or container may not route
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        authkey = secrets.token_bytes(16)
        listener = Listener(("127.0.0.1", 0), authkey=authkey)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        env[AUTH_ENV] = authkey.hex()
        host, port = listener.address
        try:
            for rank in range(1, self.world):
                command = [os.environ.get(PYTHON_ENV) or sys.executable, "-m", _WORKER]
                command += [str(rank), str(self.world), self._init, f"{host}:{port}"]
                self._procs.append(subprocess.Popen(command, env=env))
            for _ in range(1, self.world):
                conn = self._accept(listener)
                rank = int(conn.recv())
                conn.send((self.runner_args, self.threads))
                self._conns.append((rank, conn))
        except BaseException:
            self.close()
            raise
        finally:
            listener.close()
        self._conns.sort(key=lambda pair: pair[0])

    def _accept(self, listener: Listener) -> Connection:
        """The next worker's call, unless every worker died first."""
        sock = listener._listener._socket  # type: ignore[attr-defined]
        sock.settimeout(0.2)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                return listener.accept()
            except TimeoutError:
                dead = [p for p in self._procs if p.poll() is not None]
                if dead:
                    raise RuntimeError(
                        f"a tensor-parallel worker exited ({dead[0].returncode}) before it "
                        "called in"
                    ) from None
        raise RuntimeError("tensor-parallel workers did not call in")

    def connect(self) -> None:
        """Wait until every worker holds its shard, then form the process group."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        for rank, conn in self._conns:
            kind, detail = self._receive(rank, conn, deadline)
            if kind != "ready":
                self.close()
                raise RuntimeError(f"tensor-parallel rank {rank} failed to start: {detail}")
        dist.init_process_group(
            "gloo",
            init_method=self._init,
            rank=0,
            world_size=self.world,
            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
        )
        self._connected = True
        log.info("tensor parallel: %d ranks (gloo), %d thread(s) each", self.world, self.threads)

    def close(self) -> None:
        """Stop the workers (a word, then a kill) and leave the process group."""
        for _, conn in self._conns:
            with contextlib.suppress(OSError, ValueError):
                conn.send(("stop",))
        for proc in self._procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        for _, conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []
        if self._connected:
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
            self._connected = False

    def ensure(self) -> None:
        """A fresh set of workers after a loss (their KV shards start empty)."""
        if self._connected:
            return
        self.close()
        self.restarts += 1
        log.warning("tensor parallel: starting a fresh set of workers (restart %d)", self.restarts)
        self.spawn()
        self.connect()

    def lost(self, reason: str) -> WorkerLostError:
        """Tear the group down after a failure; the error to raise, which says first which
        rank exited (a SIGKILLed one is noticed by the collective a moment before it can be
        reaped, hence the short wait)."""
        details = []
        for rank, proc in enumerate(self._procs, start=1):
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=1.0)
            if proc.returncode is not None:
                details.append(f"rank {rank} exited ({_exit_status(proc.returncode)})")
        for rank, conn in self._conns:
            with contextlib.suppress(OSError, EOFError):
                while conn.poll(0):
                    kind, detail = conn.recv()
                    if kind == "failed":
                        details.append(f"rank {rank}: {detail}")
        details.append(reason)
        self.close()
        return WorkerLostError(
            "a tensor-parallel worker was lost, and with it the KV cache of every request on "
            "the engine: " + "; ".join(details)
        )

    # -- one step ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def call(self, message: tuple[Any, ...]) -> Iterator[None]:
        """Run rank 0's share of ``message`` inside: hand it to the workers first, then end
        their exchanges and wait for their word. Anything but a safepoint stop on rank 0
        leaves the workers mid-collective, so it ends the group."""
        self.ensure()
        for rank, conn in self._conns:
            try:
                conn.send(message)
            except (OSError, ValueError) as exc:
                raise self.lost(f"rank {rank} took no step ({exc})") from exc
        try:
            yield
        except StepAborted:
            self._finish()
            raise
        except BaseException as exc:
            raise self.lost(f"rank 0: {exc}") from exc
        self._finish()

    def _finish(self) -> None:
        try:
            end_exchanges()
        except RuntimeError as exc:
            raise self.lost(str(exc)) from exc
        deadline = time.monotonic() + COLLECTIVE_TIMEOUT_S
        for rank, conn in self._conns:
            kind, detail = self._receive(rank, conn, deadline)
            if kind != "done":
                raise self.lost(f"rank {rank}: {detail}")

    def _receive(self, rank: int, conn: Connection, deadline: float) -> tuple[str, Any]:
        """The worker's next word; ("gone", why) when it died or said nothing in time."""
        proc = self._procs[rank - 1]
        while time.monotonic() < deadline:
            try:
                if conn.poll(0.05):
                    kind, detail = conn.recv()
                    return str(kind), detail
            except (OSError, EOFError):
                return "gone", f"exited ({proc.poll()})"
            if proc.poll() is not None:
                return "gone", f"exited ({proc.returncode})"
        return "gone", "no answer in time"


def _exit_status(code: int) -> str:
    """ "exit code 1" or "signal 9 (SIGKILL)"."""
    if code < 0:
        return f"signal {-code} ({signal.Signals(-code).name})"
    return f"exit code {code}"


def per_rank_threads(world: int) -> int:
    """Threads each rank runs with on CPU: the engine's share of the cores, split evenly,
    since the ranks run at the same time on the same machine."""
    return max(1, torch.get_num_threads() // world)
