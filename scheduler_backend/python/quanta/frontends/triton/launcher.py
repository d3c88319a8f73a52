"""Start and stop a real ``tritonserver`` serving the ``quanta`` backend.

Why this much setup: the ``tritonserver`` binary in the ``nvidia-pytriton`` wheel ships without a
ready backend directory for custom Python-based backends, and its Python stub embeds a
libpython that must be the running interpreter's. So the launcher lays out a backend directory
(Triton's Python backend plus ``quanta/model.py``), puts this interpreter's LIBDIR first on
``LD_LIBRARY_PATH``, passes this environment's import paths to the stub (which ignores
``PYTHONPATH``), binds to the given host, and waits until the server is ready.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import importlib.resources
import importlib.util
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from quanta.frontends.triton.drain import ENV as DRAIN_ENV
from quanta.frontends.triton.drain import request_drain, wait_drained
from quanta.frontends.triton.supervisor_state import SupervisorState, register, unregister

BACKEND_NAME = "quanta"
# Triton's admin protocols, refused without the admin key (``--http-restricted-api``,
# ``--grpc-restricted-protocol``). Not restricted: health, metadata, model-config (the
# gateway reads the model's config) and inference.
RESTRICTED_APIS = ("model-repository", "logging", "trace", "shared-memory", "statistics")
ADMIN_KEY_HEADER = "quanta-admin-key"  # lower case: gRPC metadata keys must be
# Triton's gRPC frontend looks the key up under this prefix (and answers UNAVAILABLE without it)
GRPC_ADMIN_KEY_HEADER = f"triton-grpc-protocol-{ADMIN_KEY_HEADER}"
_ADMIN_KEY = re.compile(r"[A-Za-z0-9._~+/-]+")


class LaunchError(RuntimeError):
    """tritonserver could not be found, started, or did not become ready."""


def pytriton_dist_dir() -> Path | None:
    """``pytriton/tritonserver`` of the installed ``nvidia-pytriton`` wheel, if any."""
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "tritonserver"
    return path if path.is_dir() else None


def find_tritonserver(explicit: str | Path | None = None) -> Path:
    """``explicit``, else ``tritonserver`` on PATH, else the binary in ``nvidia-pytriton``."""
    if explicit is not None:
        path = Path(explicit)
        if not path.is_file():
            raise LaunchError(f"--tritonserver {path} does not exist")
        return path
    on_path = shutil.which("tritonserver")
    if on_path:
        return Path(on_path)
    dist = pytriton_dist_dir()
    if dist is not None and (dist / "bin" / "tritonserver").is_file():
        return dist / "bin" / "tritonserver"
    raise LaunchError(
        "no tritonserver found: pass --tritonserver, put one on PATH, or "
        "pip install nvidia-pytriton==0.7.0 (it bundles Triton 2.51)"
    )


def python_backend_dir(tritonserver: Path) -> Path:
    """Where Triton's own Python backend lives next to ``tritonserver``."""
    candidates = [
        tritonserver.parent.parent / "backends" / "python",  # pytriton wheel, /opt/tritonserver
        Path("/opt/tritonserver/backends/python"),
    ]
    dist = pytriton_dist_dir()
    if dist is not None:
        candidates.append(dist / "backends" / "python")
    for c in candidates:
        if (c / "libtriton_python.so").is_file():
            return c
    raise LaunchError(f"no Python backend (libtriton_python.so) found near {tritonserver}")


def python_stub(python_backend: Path) -> Path:
    """The stub matching ``python_backend``; the wheel keeps one per Python version."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    dist = pytriton_dist_dir()
    if dist is not None and python_backend.resolve().is_relative_to(dist.resolve()):
        stub = dist / "python_backend_stubs" / version / "triton_python_backend_stub"
    else:
        stub = python_backend / "triton_python_backend_stub"
    if not stub.is_file():
        raise LaunchError(f"no triton_python_backend_stub for Python {version} at {stub}")
    return stub


def layout_backend_dir(dest: Path, tritonserver: Path) -> Path:
    """Write ``dest/python`` (Triton's Python backend) and ``dest/quanta/model.py``."""
    source = python_backend_dir(tritonserver)
    python_dir = dest / "python"
    python_dir.mkdir(parents=True, exist_ok=True)
    for name in ("libtriton_python.so", "triton_python_backend_utils.py"):
        shutil.copy2(source / name, python_dir / name)
    stub = python_dir / "triton_python_backend_stub"
    shutil.copy2(python_stub(source), stub)
    stub.chmod(0o755)
    quanta_dir = dest / BACKEND_NAME
    quanta_dir.mkdir(parents=True, exist_ok=True)
    model_py = importlib.resources.files("quanta.frontends.triton") / "backend_model.py"
    (quanta_dir / "model.py").write_text(model_py.read_text(encoding="utf-8"), encoding="utf-8")
    return dest


def import_paths() -> list[str]:
    """What the stub needs on ``sys.path`` to import ``quanta`` and its dependencies."""
    import quanta

    paths = [str(Path(quanta.__file__).resolve().parent.parent)]
    for key in ("purelib", "platlib"):
        p = sysconfig.get_paths()[key]
        if p not in paths:
            paths.append(p)
    return paths


def server_env(tritonserver: Path, base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for tritonserver: libpython first, Triton's libs, this env's import paths."""
    if not sysconfig.get_config_var("Py_ENABLE_SHARED"):
        raise LaunchError(
            "Triton's Python stub loads libpython, but this interpreter was built without a "
            "shared one (e.g. pyenv: PYTHON_CONFIGURE_OPTS=--enable-shared)"
        )
    env = dict(os.environ if base is None else base)
    libdir = Path(str(sysconfig.get_config_var("LIBDIR")))
    multiarch = sysconfig.get_config_var("MULTIARCH")
    libs = [str(libdir)]
    if multiarch and (libdir / multiarch).is_dir():  # Debian keeps libpython there
        libs.append(str(libdir / multiarch))
    dist = pytriton_dist_dir()
    if dist is not None and (dist.parent.parent / "nvidia_pytriton.libs").is_dir():
        libs.append(str(dist.parent.parent / "nvidia_pytriton.libs"))
    if (tritonserver.parent.parent / "lib").is_dir():  # /opt/tritonserver/lib
        libs.append(str(tritonserver.parent.parent / "lib"))
    if env.get("LD_LIBRARY_PATH"):
        libs.append(env["LD_LIBRARY_PATH"])
    env["LD_LIBRARY_PATH"] = os.pathsep.join(libs)
    env["QUANTA_PYTHONPATH"] = os.pathsep.join(import_paths())
    # The interpreter tensor-parallel workers run under: inside Triton's Python stub,
    # ``sys.executable`` is not one (``quanta.runner.tensor_parallel.group``).
    env.setdefault("QUANTA_PYTHON", sys.executable)
    return env


@dataclass
class ServerOptions:
    """How to run one tritonserver; port 0 means "pick a free one"."""

    model_repository: Path
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    tritonserver: Path | None = None
    backend_dir: Path | None = None  # default: a temporary directory, removed on stop
    log_verbose: int = 0
    exit_timeout_s: int = 10
    extra_args: list[str] = field(default_factory=list)
    # The value of ADMIN_KEY_HEADER that Triton's admin protocols require (default: one
    # generated per server); "" leaves them open, as tritonserver does by default.
    admin_key: str | None = None

    def replica(self, i: int) -> ServerOptions:
        """The options of replica ``i`` of several on one machine: every port ten above the
        previous replica's, or any free one where 0 was asked."""
        return dataclasses.replace(
            self,
            http_port=self.http_port + 10 * i if self.http_port else 0,
            grpc_port=self.grpc_port + 10 * i if self.grpc_port else 0,
            metrics_port=self.metrics_port + 10 * i if self.metrics_port else 0,
        )


def _wait_group_gone(pgid: int, timeout: float = 10.0) -> None:
    """Until no process of the group is left (SIGKILL is delivered asynchronously), so the
    shared memory and files they held are free when we go on."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return
        time.sleep(0.05)


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on right now (best effort, as everywhere)."""
    return free_ports(1, host)[0]


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct ports nobody listens on right now. The sockets are held until all
    are bound: asked one by one, the kernel may hand the same port out twice, and Triton
    refuses to start with HTTP and gRPC on one port."""
    import contextlib
    import socket

    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(count)]
        for s in socks:
            s.bind((host, 0))
        return [int(s.getsockname()[1]) for s in socks]


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _parent_death_hook() -> Callable[[], None] | None:
    """A ``preexec_fn`` that has Linux send the child SIGTERM (Triton's clean shutdown) when
    the process that started it dies; None where there is no ``prctl``.

    Why: the server runs in a session of its own (so a Ctrl-C reaches ``quanta serve`` alone,
    which forwards it once); a ``quanta serve`` killed with SIGKILL or by the OOM killer then
    had no way to stop it, and the orphan kept the ports a restart needs. The libc call is
    resolved here, before the fork, so the child only makes the system call.
    """
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def hook() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # it died between the fork and the prctl
            os.kill(os.getpid(), signal.SIGTERM)

    return hook


class TritonServer:
    """One tritonserver process; a context manager that always stops it.

    The server dies with the process that started it (``_parent_death_hook``), and
    ``start``/``restart`` must run on a thread that lives as long as the server: Linux ties
    the parent-death signal to the starting thread.
    """

    def __init__(self, options: ServerOptions, *, log_file: Path | None = None) -> None:
        ports = ("http_port", "grpc_port", "metrics_port")
        unset = [p for p in ports if getattr(options, p) == 0]
        picked = dict(zip(unset, free_ports(len(unset), options.host), strict=True))
        self.options = dataclasses.replace(options, **picked)
        self.log_file = log_file
        self._log: IO[Any] | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._own_backend_dir = options.backend_dir is None
        self.backend_dir = options.backend_dir or Path(tempfile.mkdtemp(prefix="quanta-triton-"))
        self._shm_prefix = ""
        # Triton's last lines when it logs to the terminal (tee'd through a pipe), for the
        # message that says why it died.
        self._tail: collections.deque[str] = collections.deque(maxlen=40)
        self.restarts = 0  # how often start() ran after the first time (the backend reports it)
        self.drain_dir = Path(tempfile.mkdtemp(prefix="quanta-drain-"))
        self.admin_key = (
            secrets.token_urlsafe(24) if self.options.admin_key is None else self.options.admin_key
        )
        if not _ADMIN_KEY.fullmatch(self.admin_key or "x"):
            raise LaunchError(
                "the Triton admin key may hold only letters, digits and -._~+/ "
                "(tritonserver parses it out of <apis>:<header>=<key>)"
            )
        # what the supervisor knows of this server, for a gateway in this process
        self.state = SupervisorState(self.grpc_url)

    @property
    def admin_headers(self) -> dict[str, str]:
        """The HTTP header Triton's admin APIs (RESTRICTED_APIS) require."""
        return {ADMIN_KEY_HEADER: self.admin_key} if self.admin_key else {}

    @property
    def grpc_admin_headers(self) -> dict[str, str]:
        """The gRPC metadata its admin protocols require (tritonclient's ``headers=``)."""
        return {GRPC_ADMIN_KEY_HEADER: self.admin_key} if self.admin_key else {}

    @property
    def http_url(self) -> str:
        return f"http://{self.options.host}:{self.options.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self.options.host}:{self.options.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.options.host}:{self.options.metrics_port}/metrics"

    def command(self, binary: Path) -> list[str]:
        o = self.options
        shm_prefix = self._shm_prefix = f"quanta{os.getpid()}_{secrets.token_hex(3)}_"
        return [
            str(binary),
            f"--model-repository={Path(o.model_repository).resolve()}",
            f"--backend-directory={self.backend_dir.resolve()}",
            f"--http-address={o.host}",
            f"--http-port={o.http_port}",
            f"--grpc-address={o.host}",
            f"--grpc-port={o.grpc_port}",
            f"--metrics-address={o.host}",
            f"--metrics-port={o.metrics_port}",
            "--allow-metrics=true",
            "--allow-cpu-metrics=true",
            f"--exit-timeout-secs={o.exit_timeout_s}",
            f"--log-verbose={o.log_verbose}",
            f"--backend-config=python,shm-region-prefix-name={shm_prefix}",
            *self._restricted_args(),
            *o.extra_args,
        ]

    def _restricted_args(self) -> list[str]:
        """Triton's admin protocols behind the admin key. Why: a client that reaches the
        ports could otherwise unload the model, change logging or read statistics.
        NOTE: the key is on tritonserver's command line (it takes it no other way), so local
        users who can list processes can read it; it keeps out network clients."""
        if not self.admin_key:
            return []
        rule = f"{','.join(RESTRICTED_APIS)}:{ADMIN_KEY_HEADER}={self.admin_key}"
        return [f"--http-restricted-api={rule}", f"--grpc-restricted-protocol={rule}"]

    def start(self) -> TritonServer:
        binary = find_tritonserver(self.options.tritonserver)
        if not (self.backend_dir / BACKEND_NAME / "model.py").is_file():  # once: a restart
            layout_backend_dir(self.backend_dir, binary)  # may find old stubs still exiting
        out: IO[Any] | int = subprocess.PIPE
        if self.log_file is not None:
            out = self._log = open(self.log_file, "ab")  # noqa: SIM115 - closed in stop()
        env = server_env(binary)
        env["QUANTA_SERVER_RESTARTS"] = str(self.restarts)
        env[DRAIN_ENV] = str(self.drain_dir)
        self._proc = subprocess.Popen(
            self.command(binary),
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # Ctrl-C reaches us only; we forward it exactly once
            preexec_fn=_parent_death_hook(),
        )
        if self.log_file is None:
            threading.Thread(target=self._tee, args=(self._proc,), daemon=True).start()
        register(self.state)
        return self

    def restart(self) -> TritonServer:
        """Stop what is left of a dead server (stubs, shared memory) and start a new one on
        the same ports; the backend reports ``restarts`` as ``quanta_server_restarts_total``."""
        self.stop(remove_backend_dir=False)
        self._tail.clear()
        for stale in self.drain_dir.iterdir():  # the dead instances never unregistered
            stale.unlink()
        self.restarts += 1
        return self.start()

    def drain(self, timeout: float, announce: Callable[[], None] | None = None) -> bool:
        """Ask the running models to refuse new requests and finish theirs within
        ``timeout`` seconds (the rest end with an error); True once none is in flight.
        ``announce`` runs once the request is out (new requests are refused from then on)."""
        if self._proc is None or self._proc.poll() is not None:
            return True
        request_drain(self.drain_dir, timeout)
        if announce is not None:
            announce()
        return wait_drained(self.drain_dir, timeout + 5.0)

    def exit_status(self) -> str:
        """How the server ended, in words: "exit code 1", "signal 6 (SIGABRT)"."""
        code = None if self._proc is None else self._proc.returncode
        if code is None:
            return "still running"
        if code < 0:
            return f"signal {-code} ({signal.Signals(-code).name})"
        return f"exit code {code}"

    def log_tail(self, n: int = 20) -> list[str]:
        """Triton's last ``n`` log lines (from its log file, or from the terminal tee)."""
        if self.log_file is not None and Path(self.log_file).is_file():
            return Path(self.log_file).read_text(errors="replace").splitlines()[-n:]
        return list(self._tail)[-n:]

    def _tee(self, proc: subprocess.Popen[bytes]) -> None:
        """Copy Triton's output to ours, keeping the tail; it must drain the pipe whatever
        happens to our stdout, or Triton would block on a full pipe."""
        assert proc.stdout is not None
        for raw in proc.stdout:
            line = raw.decode("utf-8", "replace")
            self._tail.append(line.rstrip("\n"))
            with contextlib.suppress(Exception):
                sys.stdout.write(line)
                sys.stdout.flush()

    def is_ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.http_url}/v2/health/ready", timeout=2) as r:
                return bool(r.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def metrics_up(self) -> bool:
        """The metrics endpoint answers. Triton starts it after the HTTP service, so a server
        can report ready a moment before ``/metrics`` accepts connections."""
        try:
            with urllib.request.urlopen(self.metrics_url, timeout=2) as r:
                return bool(r.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def wait_ready(self, timeout: float = 300.0) -> None:
        """Block until every model is loaded and the metrics endpoint answers; raise with the
        log tail if the server exits."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc is None or self._proc.poll() is not None:
                code = None if self._proc is None else self._proc.returncode
                raise LaunchError(f"tritonserver exited with code {code}{self._log_tail()}")
            if self.is_ready() and self.metrics_up():
                return
            time.sleep(0.25)
        raise LaunchError(f"tritonserver not ready after {timeout:.0f}s{self._log_tail()}")

    def wait(self) -> int:
        """Block until the server exits; its exit code (1 when it never started)."""
        if self._proc is None:
            return 1
        return self._proc.wait()

    def stop(self, timeout: float = 30.0, *, remove_backend_dir: bool = True) -> int | None:
        """SIGINT (Triton's clean shutdown), then SIGKILL after ``timeout``; idempotent.
        Whatever the way it ended, no process of its group and none of its shared-memory
        segments outlive it."""
        code = None
        if self._proc is not None:
            if self._proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    self._proc.send_signal(signal.SIGINT)
                try:
                    self._proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(self._proc.pid, signal.SIGKILL)
                    self._proc.wait()
            # NOTE: a backend stub that Triton gave up on outlives the server in its process
            # group, holding its shared memory; nothing of the group may survive a stop.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self._proc.pid, signal.SIGKILL)
            _wait_group_gone(self._proc.pid)
            code = self._proc.returncode
            self._proc = None
            self._remove_shared_memory()
        if self._log is not None:
            self._log.close()
            self._log = None
        if remove_backend_dir:
            unregister(self.state)
            shutil.rmtree(self.drain_dir, ignore_errors=True)
            if self._own_backend_dir:
                shutil.rmtree(self.backend_dir, ignore_errors=True)
        return code

    def _remove_shared_memory(self) -> None:
        """The Python backend's segments (``/dev/shm/<prefix>*``) are left behind when the
        server dies without unloading its models."""
        if not self._shm_prefix:
            return
        for segment in Path("/dev/shm").glob(f"{self._shm_prefix}*"):
            with contextlib.suppress(OSError):
                segment.unlink()

    def __enter__(self) -> TritonServer:
        try:
            self.start()
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _log_tail(self, n: int = 40) -> str:
        lines = self.log_tail(n)
        return "\n--- tritonserver log (tail) ---\n" + "\n".join(lines) if lines else ""
