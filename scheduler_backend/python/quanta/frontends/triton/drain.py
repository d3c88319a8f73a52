"""Clean drain before a shutdown, coordinated through a directory both sides can see.

Why files: ``quanta serve`` and the backend live in different processes (tritonserver runs
the backend in stub processes of its own), and Triton offers a backend no call for "stop
taking requests, finish what you have". So ``quanta serve`` names a directory in the
environment (``QUANTA_DRAIN_DIR``); every model instance registers ``live-<instance>`` there
when it is ready; on Ctrl-C or SIGTERM ``quanta serve`` writes ``drain`` holding the drain
deadline (wall clock); each instance then refuses new requests, lets its in-flight ones
finish until the deadline, ends the rest with a clear error, and removes its ``live-`` file.
``quanta serve`` waits for the ``live-`` files to go, then stops Triton, which finds nothing
in flight and unloads at once.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

ENV = "QUANTA_DRAIN_DIR"
_POLL_S = 0.05


def drain_dir_from_env() -> Path | None:
    value = os.environ.get(ENV)
    return Path(value) if value else None


def request_drain(directory: Path, timeout: float) -> None:
    """Ask every instance to drain within ``timeout`` seconds (``quanta serve``'s side)."""
    tmp = directory / "drain.tmp"
    tmp.write_text(f"{time.time() + timeout:.3f}\n")
    tmp.replace(directory / "drain")  # atomically: an instance never reads half a deadline


def wait_drained(directory: Path, timeout: float) -> bool:
    """Until no instance is live (True), or ``timeout`` seconds passed (False)."""
    deadline = time.monotonic() + timeout
    while any(directory.glob("live-*")):
        if time.monotonic() > deadline:
            return False
        time.sleep(_POLL_S)
    return True


class DrainWatch:
    """One model instance's side: a thread that waits for ``drain`` and then drives it."""

    def __init__(
        self,
        directory: Path,
        instance: str,
        *,
        num_live: Callable[[], int],
        end_all: Callable[[str], None],
    ) -> None:
        self.directory = directory
        self._live_file = directory / f"live-{instance}"
        self._num_live = num_live
        self._end_all = end_all
        self.draining = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="quanta-drain", daemon=True)

    def is_draining(self) -> bool:
        """Checked per request (a stat), so a request that arrives after ``quanta serve``
        asked for the drain is refused even before the watch thread has seen it."""
        return self.draining.is_set() or (self.directory / "drain").exists()

    def start(self) -> None:
        self._live_file.touch()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()
        with contextlib.suppress(OSError):
            self._live_file.unlink()

    def _run(self) -> None:
        signal_file = self.directory / "drain"
        while not signal_file.exists():
            if self._stop.wait(_POLL_S):
                return
        try:
            deadline = float(signal_file.read_text())
        except (OSError, ValueError):
            deadline = time.time()
        self.draining.set()
        while self._num_live() and time.time() < deadline:
            if self._stop.wait(_POLL_S):
                return
        if self._num_live():
            self._end_all("the server shut down before this request finished (drain timeout)")
        with contextlib.suppress(OSError):
            self._live_file.unlink()
