"""The package as the Docker image installs it: a built wheel (not this checkout) holds the
backend and the build scripts and serves the demo; the Dockerfile's steps match the project.

These are the image's steps, run in a scratch install without a container engine;
tests/project/test_container.py (the docker tier) builds and runs the image itself."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from quanta.frontends.triton.launcher import free_port

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(ROOT)],
        check=True,
        capture_output=True,
        timeout=600,
    )
    (found,) = out.glob("quanta-*.whl")
    return found


@pytest.mark.slow
def test_the_wheel_holds_the_backend_the_build_steps_and_no_tests(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for needed in (
        "quanta/frontends/triton/backend_model.py",
        "quanta/build/engine_build.py",
        "quanta/frontends/openai/static/chat.html",
        "quanta/build/steps/opt.py",
        "quanta/build/steps/llama.py",
        "quanta_lab/cli.py",  # the lab's commands, named by the quanta.commands entry point
    ):
        assert needed in names, needed
    assert not any(n.startswith("tests/") for n in names)


@pytest.mark.slow
@pytest.mark.live
def test_an_installed_wheel_serves_the_demo(wheel, tmp_path):
    target = tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target)]
    subprocess.run(
        [*pip, str(wheel)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    env = {**os.environ, "PYTHONPATH": str(target), "PYTHONUNBUFFERED": "1"}
    where = subprocess.run(
        [sys.executable, "-c", "import quanta, quanta.build.steps; print(quanta.__file__)"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        cwd=tmp_path,
    )
    assert where.stdout.startswith(str(target)), where.stdout
    work = tmp_path / "work"
    work.mkdir()
    cmd = [sys.executable, "-m", "quanta.cli", "serve", "--demo", "Hello"]
    for option in ("--http-port", "--grpc-port", "--metrics-port"):
        cmd += [option, str(free_port())]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=work)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "> Hello\n" in proc.stdout


def test_the_dockerfile_matches_the_project():
    text = (ROOT / "Dockerfile").read_text()
    for source in re.findall(r"^COPY (.+) \S+$", text, re.MULTILINE):
        for path in source.split():
            assert (ROOT / path).exists(), f"COPY {path}: not in the repository"
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    torch_pin = next(d for d in pyproject["project"]["dependencies"] if d.startswith("torch"))
    assert torch_pin in text, f"the image installs another torch than {torch_pin}"
    entry = re.search(r'^ENTRYPOINT \["quanta", "serve", (.*)\]$', text, re.MULTILINE)
    cmd = re.search(r"^CMD \[(.*)\]$", text, re.MULTILINE)
    assert entry and cmd
    flags = re.findall(r'"(--[a-z-]+)"', entry[1] + cmd[1])
    help_text = subprocess.run(
        [sys.executable, "-m", "quanta.cli", "serve", "--help"],
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "200"},
        check=True,
    ).stdout
    for flag in flags:
        assert flag in help_text, f"the image runs quanta serve {flag}, which it lacks"
    # the health check asks the gateway (engine health included), Triton's readiness only
    # where no gateway listens
    health = re.search(r"CMD curl -fsS -m \d+ (\S+)", text)
    assert health and health[1].endswith(":9000/health")
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ".venv" in ignored and "engines/*" in ignored
