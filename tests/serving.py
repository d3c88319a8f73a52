"""A long-running command under test: started in its own process group, read line by line,
stopped with Ctrl-C (SIGINT) as a user would."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path


class Background:
    """``text`` run through bash (``exec``, so the signal reaches the command itself)."""

    def __init__(self, text: str, cwd: Path, env: dict[str, str] | None = None) -> None:
        self.text = text
        self.proc = subprocess.Popen(
            ["bash", "-c", f"exec {text.rstrip(' &')}"],
            cwd=cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.lines: list[str] = []

    def wait_for_line(self, prefix: str, timeout: float = 300) -> str:
        deadline = time.monotonic() + timeout
        assert self.proc.stdout is not None
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line and self.proc.poll() is not None:
                break
            self.lines.append(line)
            if line.startswith(prefix):
                return line
        raise AssertionError(f"{self.text}: no {prefix!r} line\n" + "".join(self.lines))

    def stop(self) -> int:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        return self.proc.returncode
