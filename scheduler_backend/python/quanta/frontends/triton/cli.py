"""``quanta serve``: run a real Triton Inference Server with the ``quanta`` backend.

Registered into the main Typer app by ``quanta.cli``. Imports of the launcher and client happen
inside the command, so ``quanta --help`` loads neither tritonclient nor torch.
"""

from __future__ import annotations

import signal
import tempfile
from pathlib import Path
from typing import Annotated, Any

import typer


def register(app: typer.Typer, bench_app: typer.Typer) -> None:
    """Add ``serve`` to the main app (``bench_app`` is unused: no Triton benchmark yet)."""
    app.command("serve")(serve)


def serve(
    model_repository: Annotated[
        Path | None,
        typer.Option(
            help="Triton model repository (default: ./triton_models if present, "
            "else a generated one with the tiny default model)"
        ),
    ] = None,
    host: Annotated[str, typer.Option(help="address all three endpoints bind to")] = "127.0.0.1",
    http_port: Annotated[
        int, typer.Option(envvar="QUANTA_HTTP_PORT", help="HTTP port (0: any free port)")
    ] = 8000,
    grpc_port: Annotated[
        int, typer.Option(envvar="QUANTA_GRPC_PORT", help="gRPC port (0: any free port)")
    ] = 8001,
    metrics_port: Annotated[
        int, typer.Option(envvar="QUANTA_METRICS_PORT", help="Prometheus port (0: any free port)")
    ] = 8002,
    tritonserver: Annotated[
        Path | None,
        typer.Option(help="tritonserver binary (default: on PATH, else nvidia-pytriton's)"),
    ] = None,
    backend_dir: Annotated[
        Path | None, typer.Option(help="where to lay out the backends (default: a temp dir)")
    ] = None,
    log_file: Annotated[
        Path | None, typer.Option(help="write Triton's log here instead of the terminal")
    ] = None,
    log_verbose: Annotated[int, typer.Option(help="Triton --log-verbose level")] = 0,
    ready_timeout: Annotated[float, typer.Option(help="seconds to wait for model load")] = 600.0,
    demo: Annotated[
        str | None,
        typer.Option(help="once ready, stream one request with this prompt, then shut down"),
    ] = None,
    model_name: Annotated[
        str, typer.Option(help="model the --demo request and the OpenAI gateway use")
    ] = "quanta",
    openai_port: Annotated[
        int | None,
        typer.Option(help="also serve the OpenAI-compatible API on this port (0: any free port)"),
    ] = None,
) -> None:
    """Serve the model repository through tritonserver (HTTP, gRPC, metrics) until Ctrl-C."""
    from quanta.frontends.triton.launcher import LaunchError, ServerOptions, TritonServer
    from quanta.frontends.triton.repository import write_model_repository

    with tempfile.TemporaryDirectory(prefix="quanta-models-") as tmp:
        repo = model_repository
        if repo is None:
            repo = Path("triton_models")
            if not repo.is_dir():
                repo = write_model_repository(Path(tmp))
                typer.echo(f"no ./triton_models: serving the default tiny model from {repo}")
        server = TritonServer(
            ServerOptions(
                model_repository=repo,
                host=host,
                http_port=http_port,
                grpc_port=grpc_port,
                metrics_port=metrics_port,
                tritonserver=tritonserver,
                backend_dir=backend_dir,
                log_verbose=log_verbose,
            ),
            log_file=log_file,
        )
        # `kill` stops the server cleanly too, and Ctrl-C / `kill -INT` works even when the
        # process was started with SIGINT ignored (a background job of a script).
        signal.signal(signal.SIGTERM, _interrupt)
        signal.signal(signal.SIGINT, _interrupt)
        gateway = None
        try:
            server.start()
            server.wait_ready(ready_timeout)
            typer.echo(f"HTTP    {server.http_url}")
            typer.echo(f"gRPC    {server.grpc_url}")
            typer.echo(f"metrics {server.metrics_url}")
            if openai_port is not None:
                gateway = _start_gateway(server, repo, host, openai_port, model_name)
                typer.echo(f"OpenAI  {gateway.url}/v1")
            if demo is not None:
                _demo(server.http_url, model_name, demo)
                return
            typer.echo("ready; Ctrl-C stops the server")
            code = server.wait()
            if code != 0:
                raise typer.Exit(code)
        except LaunchError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(1) from None
        except KeyboardInterrupt:
            typer.echo("\nshutting down tritonserver ...")
        finally:
            if gateway is not None:
                gateway.stop()
            server.stop()


def _start_gateway(server: Any, repo: Path, host: str, port: int, model_name: str) -> Any:
    from quanta.frontends.openai.server import (
        GatewayError,
        model_dir_from_repository,
        start_gateway,
    )
    from quanta.frontends.triton.launcher import LaunchError, free_port

    try:
        return start_gateway(
            server.grpc_url,
            host=host,
            port=port or free_port(host),
            model_name=model_name,
            model_dir=model_dir_from_repository(repo, model_name),
        )
    except GatewayError as exc:  # reported (and Triton stopped) like a failed launch
        raise LaunchError(str(exc)) from None


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _demo(url: str, model: str, prompt: str) -> None:
    from quanta.core.request import SamplingParams
    from quanta.frontends.triton.client import generate

    typer.echo(f"> {prompt}")
    params = SamplingParams(max_tokens=32, temperature=0.0)
    for piece in generate(url, prompt, params, model=model, stream=True):
        typer.echo(piece, nl=False)
    typer.echo()
