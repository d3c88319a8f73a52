"""``quanta serve``: run a real Triton Inference Server with the ``quanta`` backend.

Registered into the main Typer app by ``quanta.cli``. Imports of the launcher and client happen
inside the command, so ``quanta --help`` loads neither tritonclient nor torch.
"""

from __future__ import annotations

import importlib
import signal
import tempfile
from pathlib import Path
from typing import Annotated, Any

import typer

from quanta.cli_options import (
    api_key_policies,
    check_state_policy,
    with_key_weights,
)
from quanta.config.cli import env_prefix, options_from
from quanta.config.models import CacheArgs, EngineArgs, SchedulerArgs, ServingArgs
from quanta.core.pooling import PoolingParams


def register(app: typer.Typer, bench_app: typer.Typer) -> None:
    """Add ``serve``, ``check-config`` and ``reset-prefix-cache`` to the main app."""
    app.command("serve", context_settings=env_prefix("serve"))(serve)
    app.command("check-config")(check_config)
    app.command("reset-prefix-cache")(reset_prefix_cache)


@options_from(
    engine=EngineArgs,
    cache=CacheArgs,
    scheduler=SchedulerArgs,
    serving=ServingArgs,
    only={
        "cache": ("block_size", "kv_cache_memory", "host_cache_memory", "gpu_memory_utilization")
    },
)
def serve(
    model: Annotated[
        Path | None,
        typer.Argument(
            help="engine (quanta build), HF checkpoint directory, LLaMA .gguf file or a "
            "`quanta fetch-model` catalogue name to serve; without it, the model repository"
        ),
    ] = None,
    model_repository: Annotated[
        Path | None,
        typer.Option(
            help="Triton model repository (default: ./triton_models if present, "
            "else a generated one with the tiny default model)"
        ),
    ] = None,
    demo: Annotated[
        str | None,
        typer.Option(help="once ready, stream one request with this prompt, then shut down"),
    ] = None,
    model_name: Annotated[
        str | None,
        typer.Option(
            help="which model of the repository the --demo request and the OpenAI gateway use "
            "(default: the served model name)"
        ),
    ] = None,
    *,
    engine: EngineArgs,
    cache: CacheArgs,
    scheduler: SchedulerArgs,
    serving: ServingArgs,
) -> None:
    """Serve MODEL, or the model repository, through tritonserver (HTTP, gRPC, metrics)."""
    from quanta.frontends.triton.check import check_path
    from quanta.frontends.triton.launcher import LaunchError, ServerOptions, TritonServer
    from quanta.frontends.triton.model_entry import EntryError, write_entry
    from quanta.frontends.triton.repository import (
        DEFAULT_MODEL_NAME,
        model_dir_from_repository,
        write_model_repository,
    )
    from quanta.frontends.triton.supervise import drain_all, supervise_all

    options = _policy_options(scheduler)
    keys = api_key_policies(serving.api_key, serving.api_key_file)
    if keys and serving.openai_port is None:
        raise typer.BadParameter("API keys guard the OpenAI gateway: give --openai-port too")
    options = with_key_weights(scheduler.policy, options, keys)  # a key's weight: its tenant's
    flags = _model_parameters(engine, cache, scheduler, serving, options)
    gateway_options: dict[str, Any] = {
        "api_keys": keys,
        "max_request_bytes": serving.max_request_bytes,
        "max_file_bytes": serving.max_file_bytes,
        "max_model_len": engine.max_seq_len,
        "max_prompt_bytes": serving.max_prompt_bytes,
        "allowed_hosts": tuple(serving.allowed_hosts or ()),
        "pooler_config": serving.pooler_config or PoolingParams(),
        "tool_call_parser": serving.tool_call_parser,
    }
    with tempfile.TemporaryDirectory(prefix="quanta-models-") as tmp:
        repo = model_repository
        served = serving.served_model_name or DEFAULT_MODEL_NAME
        if model is not None:
            if model_repository is not None:
                raise typer.BadParameter("give MODEL or --model-repository, not both")
            model = resolve_model(model, engine.dtype)
            try:
                repo = write_entry(Path(tmp), served, model, flags)
            except EntryError as exc:
                typer.echo(f"error: {exc}", err=True)
                raise typer.Exit(1) from None
            typer.echo(f"serving {model} as model {served!r}")
        elif repo is None and not Path("triton_models").is_dir():
            repo = write_model_repository(Path(tmp), model_name=served, overrides=flags)
            typer.echo(f"no ./triton_models: serving the default tiny model from {repo}")
        else:
            repo = repo or Path("triton_models")
            if flags or serving.served_model_name:
                given = ", ".join(f"--{k.replace('_', '-')}" for k in flags)
                raise typer.BadParameter(
                    f"{given or '--served-model-name'} set the model served from MODEL or the "
                    f"default model; the models of {repo} take theirs from config.pbtxt"
                )
        problems = check_path(repo, cwd=Path.cwd())
        for problem in problems:
            typer.echo(str(problem), err=True)
        if any(p.severity == "error" for p in problems):
            typer.echo(f"error: {repo} would not load; nothing started", err=True)
            raise typer.Exit(1)
        model_name = model_name or served
        if serving.replicas > 1 and demo is not None:
            raise typer.BadParameter("--demo runs one server: leave out --replicas")
        options = ServerOptions(
            model_repository=repo,
            host=serving.triton_host,
            http_port=serving.http_port,
            grpc_port=serving.grpc_port,
            metrics_port=serving.metrics_port,
            tritonserver=serving.tritonserver,
            backend_dir=serving.backend_dir,
            log_verbose=serving.log_verbose,
            admin_key=serving.triton_admin_key,
        )
        servers = [
            TritonServer(options.replica(i), log_file=_replica_log(serving.log_file, i))
            for i in range(serving.replicas)
        ]
        server = servers[0]
        # `kill` stops the server cleanly too, and Ctrl-C / `kill -INT` works even when the
        # process was started with SIGINT ignored (a background job of a script).
        signal.signal(signal.SIGTERM, _interrupt)
        signal.signal(signal.SIGINT, _interrupt)
        gateway = None
        try:
            for s in servers:  # NOTE: all start loading at once, then each is waited for
                s.start()
            for i, s in enumerate(servers):
                s.wait_ready(serving.ready_timeout)
                label = f" (replica {i})" if serving.replicas > 1 else ""
                typer.echo(f"HTTP    {s.http_url}{label}")
                typer.echo(f"gRPC    {s.grpc_url}{label}")
                typer.echo(f"metrics {s.metrics_url}{label}")
            if serving.openai_port is not None:
                gateway = _start_gateway(
                    servers,
                    repo,
                    serving.host,
                    serving.openai_port,
                    model_name,
                    serving.state_dir,
                    serving.router,
                    **gateway_options,
                )
                typer.echo(f"OpenAI  {gateway.url}/v1")
            if demo is not None:
                entry = model if model is not None else model_dir_from_repository(repo, model_name)
                _demo(
                    server.http_url,
                    model_name,
                    demo,
                    entry,
                    gateway and gateway.url,
                    next(iter(keys), None),
                )
                return
            host, triton_host = serving.host, serving.triton_host
            if gateway is not None and host != triton_host:
                typer.echo(f"Triton's ports stay on {triton_host}, behind the gateway")
            elif gateway is None and host != triton_host:
                typer.echo(
                    f"note: --host {host} binds the OpenAI gateway, which --openai-port starts; "
                    f"Triton's ports bind {triton_host} (--triton-host)",
                    err=True,
                )
            typer.echo("ready; Ctrl-C stops the server" + ("s" if serving.replicas > 1 else ""))
            code = supervise_all(
                servers, serving.max_restarts, serving.ready_timeout, serving.max_restart_delay
            )
            if code != 0:
                raise typer.Exit(code)
        except LaunchError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(1) from None
        except KeyboardInterrupt:
            drain_all(servers, serving.drain_timeout)
            typer.echo("shutting down tritonserver ...")
        finally:
            # NOTE: a further Ctrl-C must not interrupt the stop half way and orphan Triton;
            # the stop is bounded anyway (Triton's exit timeout, then SIGKILL).
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            if gateway is not None:
                gateway.stop()
            for s in servers:
                s.stop()


def _policy_options(scheduler: SchedulerArgs) -> dict[str, Any] | None:
    """``--policy-option`` pairs and ``--state-url`` as the policy's options (None: none)."""
    options = scheduler.policy_options() or None
    if scheduler.state_url is not None:
        options = {**(options or {}), "state_url": scheduler.state_url}
        check_state_policy(scheduler.policy, options)
    return options


def _model_parameters(
    engine: EngineArgs,
    cache: CacheArgs,
    scheduler: SchedulerArgs,
    serving: ServingArgs,
    policy_options: dict[str, Any] | None,
) -> dict[str, str]:
    """The ``config.pbtxt`` parameters of the options given (an option not given: none)."""
    from quanta.frontends.triton.model_entry import EntryError, served_parameters

    try:
        return served_parameters(
            policy=scheduler.policy,
            policy_options=policy_options,
            max_num_seqs=scheduler.max_num_seqs,
            max_num_batched_tokens=scheduler.max_num_batched_tokens,
            **engine.model_dump(exclude_none=True),
            **cache.model_dump(exclude_none=True),
            io_layout=serving.io_layout,
        )
    except EntryError as exc:
        raise typer.BadParameter(str(exc)) from None


def check_config(
    path: Annotated[
        Path, typer.Argument(help="model repository, model folder, or config.pbtxt file")
    ],
    cwd: Annotated[
        Path | None,
        typer.Option(
            help="the server's working directory, which relative model_dir resolve "
            "against (default: here)"
        ),
    ] = None,
    verify: Annotated[
        bool, typer.Option(help="also check engine weight files against their sha256")
    ] = False,
) -> None:
    """Check every config.pbtxt parameter the quanta backend reads, before Triton loads it."""
    from quanta.frontends.triton.check import check_path

    problems = check_path(path, cwd=cwd, verify=verify)
    for problem in problems:
        typer.echo(str(problem))
    errors = sum(p.severity == "error" for p in problems)
    if errors:
        typer.echo(f"{errors} error(s)")
        raise typer.Exit(1)
    typer.echo(f"{path}: OK" + (f" ({len(problems)} warning(s))" if problems else ""))


def reset_prefix_cache(
    url: Annotated[
        str, typer.Option(help="Triton server host:port (HTTP, or gRPC with --grpc)")
    ] = "127.0.0.1:8000",
    model_name: Annotated[str, typer.Option(help="Triton model name")] = "quanta",
    grpc: Annotated[bool, typer.Option(help="send it over gRPC")] = False,
) -> None:
    """Make a served model forget every cached prompt prefix (vLLM's reset_prefix_cache):
    requests sent afterwards compute their prompts in full."""
    client = importlib.import_module("quanta.frontends.triton.client")
    try:
        client.reset_prefix_cache(url, model_name, use_grpc=grpc)
    except client.GenerateError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"model {model_name!r}: prefix cache reset")


def _replica_log(log_file: Path | None, i: int) -> Path | None:
    """Replica ``i``'s Triton log beside the first one's (``triton.1.log``)."""
    if log_file is None or i == 0:
        return log_file
    return log_file.with_name(f"{log_file.stem}.{i}{log_file.suffix}")


def _start_gateway(
    servers: list[Any],
    repo: Path,
    host: str,
    port: int,
    model_name: str,
    state_dir: Path,
    router: str,
    **gateway_options: Any,
) -> Any:
    from quanta.frontends.openai.server import GatewayError, start_gateway
    from quanta.frontends.triton.launcher import LaunchError, free_port
    from quanta.frontends.triton.repository import model_dir_from_repository

    try:
        upstreams = tuple(s.grpc_url for s in servers) if len(servers) > 1 else ()
        return start_gateway(
            servers[0].grpc_url,
            upstreams=upstreams,
            router=router,
            host=host,
            port=port or free_port(host),
            model_name=model_name,
            model_dir=model_dir_from_repository(repo, model_name),
            state_dir=state_dir,
            # NOTE: one server's only: several would repeat the same series under one name
            engine_metrics_url=servers[0].metrics_url if len(servers) == 1 else None,
            **gateway_options,
        )
    except GatewayError as exc:  # reported (and Triton stopped) like a failed launch
        raise LaunchError(str(exc)) from None


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def resolve_model(model: Path, dtype: str | None) -> Path:
    """A catalogue name or a ``.gguf`` file becomes its cached engine; a directory stays."""
    from quanta.build.cli import engine_from_gguf
    from quanta.build.fetch import CATALOGUE, FetchError, fetch_gguf

    if not model.exists() and str(model) in CATALOGUE:
        try:
            model = fetch_gguf(str(model))
        except FetchError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(1) from None
    if model.is_file() and model.suffix == ".gguf":
        typer.echo(f"engine for {model.name} (built once, then cached) ...")
        return engine_from_gguf(model, dtype)
    return model


def _demo(
    url: str,
    model: str,
    prompt: str,
    model_dir: Path | None,
    gateway_url: str | None,
    api_key: str | None = None,
) -> None:
    """One greedy answer through Triton and, when the gateway runs, one through the OpenAI
    chat endpoint. A chat model gets its own template on the Triton request too, so both
    answer the question rather than continue its text."""
    import json
    import urllib.request

    from quanta.core.request import SamplingParams
    from quanta.frontends.triton.client import generate
    from quanta.text.chat_template import ChatTemplate, Turn

    template = ChatTemplate.from_model_dir(model_dir) if model_dir is not None else None
    text = prompt
    if template is not None and template.has_own_template:
        text = template.render([Turn("user", prompt)])
    typer.echo(f"> {prompt}")
    params = SamplingParams(max_tokens=DEMO_TOKENS, temperature=0.0)
    typer.echo("triton: ", nl=False)
    for piece in generate(url, text, params, model=model, stream=True):
        typer.echo(piece, nl=False)
    typer.echo()
    if gateway_url is None:
        return
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": DEMO_TOKENS,
        "temperature": 0.0,
    }
    request = urllib.request.Request(
        f"{gateway_url}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"}
        | ({} if api_key is None else {"Authorization": f"Bearer {api_key}"}),
    )
    with urllib.request.urlopen(request, timeout=300) as response:
        answer = json.loads(response.read())
    typer.echo(f"openai: {answer['choices'][0]['message']['content']}")


DEMO_TOKENS = 48
