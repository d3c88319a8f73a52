"""The container image, built from the Dockerfile and run as an operator runs it: an answer
through the authenticated gateway with Triton's ports kept inside, a health check that turns
unhealthy when the engine loop stops, and ``docker stop`` draining a stream.

Where Docker Hub is out of reach the base is made from Debian's packages
(``scripts/docker-base.sh``), and torch's CPU wheel comes from this machine's pip
``find-links`` directory, served on the loopback to a build on the host's network, when its
index is out of reach too. Skipped where ``dockerd`` is not running and cannot be started (not
installed, not root); CI installs and starts it (``.ci/run``).
"""

from __future__ import annotations

import contextlib
import functools
import http.server
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import threading
import time
import tomllib
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from serving import wait_for

ROOT = Path(__file__).resolve().parents[2]
# A cold build pulls torch and the dependencies from the index: minutes, not seconds.
pytestmark = [pytest.mark.docker, pytest.mark.timeout(2400)]

IMAGE = "quanta:test"
OFFICIAL_BASE = "python:3.11-slim-bookworm"  # the Dockerfile's default BASE
DEBIAN_BASE = "quanta-base:bookworm"  # scripts/docker-base.sh's
API_KEY = "sk-quanta-" + secrets.token_hex(16)
MODEL = "quanta"  # the image's default model (triton_models/quanta: opt-tiny, built at load)
WHEELS_PORT = 8765  # where the torch wheel is served to the build (any free one if taken)
STUB = "triton_python_backend_stub"  # the process the quanta backend's engine loop runs in
# Run in the container (no procps there): signal every stub, print their pids.
SIGNAL_STUB = f"""
import contextlib, os, signal, sys
for pid in filter(str.isdigit, os.listdir("/proc")):
    with contextlib.suppress(OSError):
        with open(f"/proc/{{pid}}/cmdline", "rb") as cmdline:
            if cmdline.read().split(b"\\0")[0].endswith(b"{STUB}"):
                os.kill(int(pid), getattr(signal, "SIG" + sys.argv[1]))
                print(pid)
"""


def docker(*args: str, timeout: float = 120, check: bool = True) -> str:
    """``docker ARGS``'s output; a failure shows what docker said."""
    proc = subprocess.run(
        ["docker", *args], capture_output=True, text=True, timeout=timeout, check=False
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"docker {' '.join(args)}: {proc.returncode}\n{proc.stderr}")
    return proc.stdout.strip()


def docker_up() -> bool:
    return (
        shutil.which("docker") is not None
        and subprocess.run(["docker", "info"], capture_output=True, timeout=60).returncode == 0
    )


@pytest.fixture(scope="module")
def dockerd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """A running dockerd: the one already up, else one started here (and stopped after)."""
    if docker_up():
        yield
        return
    if shutil.which("dockerd") is None or shutil.which("docker") is None:
        pytest.skip("no docker engine (Debian: apt-get install docker.io)")
    if os.getuid() != 0:
        pytest.skip("dockerd is not running and only root can start it")
    log = tmp_path_factory.mktemp("dockerd") / "dockerd.log"
    with log.open("w") as out:
        proc = subprocess.Popen(["dockerd"], stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not docker_up():
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.skip(f"dockerd did not start: {log.read_text()[-2000:]}")
            time.sleep(0.5)
        yield
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def torch_pin() -> str:
    """The version pyproject.toml pins torch to (the Dockerfile installs the same)."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return next(d for d in deps if d.startswith("torch==")).split("==", 1)[1]


def local_torch_wheel() -> Path | None:
    """torch's CPU wheel in one of this machine's pip find-links directories, if any."""
    where = os.environ.get("PIP_FIND_LINKS", "").split()
    config = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True
    )
    where += re.findall(r"find-links='([^']*)'", config.stdout)
    for entry in (w for line in where for w in line.split()):
        if "://" in entry and not entry.startswith("file://"):
            continue
        directory = Path(entry.removeprefix("file://"))
        found = sorted(directory.glob(f"torch-{torch_pin()}+cpu-cp311-cp311-*linux*x86_64.whl"))
        if found:
            return found[0]
    return None


@contextlib.contextmanager
def served_on_loopback(directory: Path) -> Iterator[str]:
    """``directory`` as a pip find-links page on 127.0.0.1, for a build on the host network."""

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:
            pass

    handler = functools.partial(Quiet, directory=str(directory))
    try:  # one port every run: the URL is a build argument, part of the layers' cache key
        server = http.server.ThreadingHTTPServer(("127.0.0.1", WHEELS_PORT), handler)
    except OSError:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"  # the Dockerfile's TORCH_INDEX


def reachable(url: str) -> bool:
    """Whether ``url`` answers at all (a build without a local wheel needs it)."""
    try:
        urllib.request.urlopen(url, timeout=10).close()
    except urllib.error.HTTPError:
        return True  # it answered
    except OSError:
        return False
    return True


def image_exists(name: str) -> bool:
    inspect = ["docker", "image", "inspect", name]
    return subprocess.run(inspect, capture_output=True, timeout=60).returncode == 0


def base_args() -> list[str]:
    """The build arguments that pick a base image this machine has or can make."""
    if base := os.environ.get("QUANTA_DOCKER_BASE"):
        return ["--build-arg", f"BASE={base}"]
    if image_exists(OFFICIAL_BASE):
        return []
    if shutil.which("debootstrap") is None:
        pytest.skip(f"no {OFFICIAL_BASE} image and no debootstrap to make a Debian base")
    subprocess.run(
        ["bash", str(ROOT / "scripts" / "docker-base.sh"), DEBIAN_BASE],
        check=True,
        capture_output=True,
        timeout=1200,
    )
    return ["--build-arg", f"BASE={DEBIAN_BASE}"]


@pytest.fixture(scope="module")
def image(dockerd: None) -> str:
    """The Dockerfile built as ``quanta:test`` (layers cached by dockerd between runs)."""
    args = ["build", "--network", "host", *base_args(), "-t", IMAGE, str(ROOT)]
    wheel = local_torch_wheel()
    if wheel is None and not reachable(TORCH_CPU_INDEX):
        pytest.skip(f"no local torch CPU wheel and {TORCH_CPU_INDEX} cannot be reached")
    with contextlib.ExitStack() as stack:
        if wheel is not None:
            url = stack.enter_context(served_on_loopback(wheel.parent))
            args[1:1] = ["--build-arg", "TORCH_INDEX=", "--build-arg", f"WHEELS={url}"]
        docker(*args, timeout=2400)
    return IMAGE


@dataclass
class Container:
    """A running container of the image and its gateway's URL on the host's loopback."""

    id: str
    url: str

    def health(self) -> str:
        return docker("inspect", "-f", "{{.State.Health.Status}}", self.id)

    def logs(self) -> str:
        proc = subprocess.run(
            ["docker", "logs", self.id], capture_output=True, text=True, timeout=60
        )
        return proc.stdout + proc.stderr

    def signal_engine(self, signal: str) -> None:
        """Send ``signal`` (STOP, CONT) to the Python stub that runs the engine loop."""
        pids = docker("exec", self.id, "python3", "-c", SIGNAL_STUB, signal).split()
        assert pids, f"no {STUB} in the container"


def start_container(image: str, *, key_in_env: bool = False) -> Container:
    """The image run as documented, with a key (``--api-key``, or ``QUANTA_API_KEY`` and the
    image's own CMD), the gateway published on 127.0.0.1 only and the health check polled
    every second (the image's own cadence is the Dockerfile's)."""
    key = ["-e", f"QUANTA_API_KEY={API_KEY}"] if key_in_env else []
    args = [] if key_in_env else ["--openai-port", "9000", "--api-key", API_KEY]
    cid = docker(
        "run",
        "-d",
        *key,
        "-p",
        "127.0.0.1::9000",
        "--health-interval",
        "1s",
        "--health-timeout",
        "5s",
        "--health-retries",
        "3",
        "--health-start-period",
        "600s",
        # one torch thread, as every server the suite starts (tests/conftest.py)
        "-e",
        "OMP_NUM_THREADS=1",
        image,
        *args,
    )
    port = docker("port", cid, "9000/tcp").splitlines()[0].rsplit(":", 1)[1]
    container = Container(cid, f"http://127.0.0.1:{port}")

    def healthy() -> bool:
        state = json.loads(docker("inspect", "-f", "{{json .State}}", cid))
        if not state["Running"]:
            raise AssertionError("the container exited:\n" + container.logs())
        return state["Health"]["Status"] == "healthy"

    try:
        wait_for(healthy, timeout=600, what="a healthy container", interval=1)
        wait_for(lambda: "OpenAI" in container.logs(), timeout=120, what="the gateway")
    except BaseException:
        remove(container)
        raise
    return container


def remove(container: Container) -> None:
    docker("rm", "-f", container.id, check=False)


@pytest.fixture(scope="module")
def container(image: str) -> Iterator[Container]:
    running = start_container(image)
    yield running
    remove(running)


def post(url: str, body: dict[str, object], key: str | None) -> tuple[int, bytes]:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(url, json.dumps(body).encode(), headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def listening(container: Container) -> dict[int, str]:
    """Port -> address of every listening TCP socket in the container (from /proc/net)."""
    found: dict[int, str] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in docker("exec", container.id, "cat", table).splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            if state != "0A":  # LISTEN
                continue
            address, port = local.split(":")
            if len(address) == 8:
                address = ".".join(str(b) for b in reversed(bytes.fromhex(address)))
            else:
                address = "::" if set(address) == {"0"} else address
            found[int(port, 16)] = address
    return found


def test_the_gateway_answers_with_the_key_and_triton_stays_inside(container: Container):
    from openai import OpenAI

    client = OpenAI(base_url=container.url + "/v1", api_key=API_KEY, max_retries=0)
    answer = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4)
    assert answer.choices[0].text and answer.usage.completion_tokens == 4

    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 4}
    assert post(container.url + "/v1/completions", body, None)[0] == 401
    assert post(container.url + "/v1/completions", body, API_KEY + "x")[0] == 401

    ports = listening(container)
    assert ports[9000] in ("0.0.0.0", "::"), ports  # the gateway, published by -p
    for triton_port in (8000, 8001, 8002):  # HTTP, gRPC, metrics: the loopback only
        assert ports[triton_port] == "127.0.0.1", ports
    assert docker("exec", container.id, "id", "-u") != "0"


def test_the_health_check_turns_unhealthy_when_the_engine_loop_stops(container: Container):
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 4}
    answers: list[tuple[int, bytes]] = []
    container.signal_engine("STOP")
    try:
        # a request waiting on the stopped loop: work it makes no progress on
        waiting = threading.Thread(
            target=lambda: answers.append(post(container.url + "/v1/completions", body, API_KEY)),
            daemon=True,
        )
        waiting.start()
        wait_for(
            lambda: container.health() == "unhealthy",
            timeout=180,
            what="the health check to fail",
            interval=1,
        )
    finally:
        container.signal_engine("CONT")
    # Once the engine runs again (the same stub, or a restarted server) the waiting request
    # has an answer, not a hang, and the container is healthy again by itself.
    waiting.join(timeout=180)
    assert answers, "the request sent while the engine was stopped never got an answer"
    wait_for(
        lambda: container.health() == "healthy",
        timeout=300,
        what="the container to be healthy again",
        interval=1,
    )
    answer = post(container.url + "/v1/completions", body, API_KEY)
    assert answer[0] == 200, answer


def test_docker_stop_drains_a_stream(image: str):
    running = start_container(image, key_in_env=True)
    try:
        url = running.url + "/v1/completions"
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"}
        body = {
            "model": MODEL,
            "prompt": "Hello",
            "max_tokens": 64,
            "ignore_eos": True,
            "stream": True,
        }
        request = urllib.request.Request(url, json.dumps(body).encode(), headers)
        stream = urllib.request.urlopen(request, timeout=120)
        first = stream.readline()
        assert first.startswith(b"data: {"), first
        # Hold the loop so the stream is surely in flight when SIGTERM lands, then let it go
        # once quanta serve has begun the drain.
        running.signal_engine("STOP")
        stop = subprocess.Popen(
            ["docker", "stop", "-t", "90", running.id],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            wait_for(lambda: "draining:" in running.logs(), timeout=60, what="the drain")
        finally:
            running.signal_engine("CONT")
        frames = [first, *stream.read().splitlines()]
        data = [f.removeprefix(b"data: ") for f in frames if f.startswith(b"data: ")]
        assert data[-1] == b"[DONE]", frames[-5:]
        chunks = [json.loads(d) for d in data[:-1]]
        errors = [c for c in chunks if "error" in c]
        if not errors:  # the stream finished inside the drain: every token arrived
            assert chunks[-1]["choices"][0]["finish_reason"] == "length", chunks[-3:]
        else:  # or it was ended by the drain, saying so
            assert "shut down" in json.dumps(errors[-1]), errors[-1]
        assert stop.wait(timeout=120) == 0, stop.stderr and stop.stderr.read()
        logs = running.logs()
        assert "drained" in logs, logs[-3000:]
        exit_code = docker("inspect", "-f", "{{.State.ExitCode}}", running.id)
        assert exit_code == "0", logs[-3000:]
    finally:
        remove(running)
