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
    AllowedHostsOpt,
    ApiKeyFileOpt,
    ApiKeyOpt,
    AttentionKernelOpt,
    LinearKernelOpt,
    MaxFileBytesOpt,
    MaxPromptBytesOpt,
    MaxRequestBytesOpt,
    PolicyOpt,
    PrefixCachingOverrideOpt,
    RouterOpt,
    SpeculativeConfigOpt,
    TensorParallelOpt,
    api_key_policies,
    check_state_policy,
    parse_options,
    parse_speculative_config,
    with_key_weights,
)
from quanta.frontends.openai.limits import DEFAULT_MAX_FILE_BYTES, DEFAULT_MAX_REQUEST_BYTES


def register(app: typer.Typer, bench_app: typer.Typer) -> None:
    """Add ``serve``, ``check-config`` and ``reset-prefix-cache`` to the main app."""
    app.command("serve")(serve)
    app.command("check-config")(check_config)
    app.command("reset-prefix-cache")(reset_prefix_cache)


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
    host: Annotated[
        str,
        typer.Option(help="address the OpenAI gateway binds to (Triton's ports: --triton-host)"),
    ] = "127.0.0.1",
    triton_host: Annotated[
        str,
        typer.Option(
            help="address Triton's HTTP, gRPC and metrics ports bind to; the loopback keeps "
            "them behind the gateway, another address exposes them deliberately"
        ),
    ] = "127.0.0.1",
    triton_admin_key: Annotated[
        str | None,
        typer.Option(
            envvar="QUANTA_TRITON_ADMIN_KEY",
            help="value of the quanta-admin-key header Triton's admin APIs (model-repository, "
            "logging, trace, shared-memory, statistics) require (default: a random one per "
            "start; '': leave them open)",
        ),
    ] = None,
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
        str | None,
        typer.Option(
            help="which model of the repository the --demo request and the OpenAI gateway use "
            "(default: the served model name)"
        ),
    ] = None,
    openai_port: Annotated[
        int | None,
        typer.Option(help="also serve the OpenAI-compatible API on this port (0: any free port)"),
    ] = None,
    state_dir: Annotated[
        Path, typer.Option(help="where the OpenAI gateway keeps Batch API files and batches")
    ] = Path("quanta-state"),
    api_key: ApiKeyOpt = None,
    api_key_file: ApiKeyFileOpt = None,
    max_request_bytes: MaxRequestBytesOpt = DEFAULT_MAX_REQUEST_BYTES,
    max_file_bytes: MaxFileBytesOpt = DEFAULT_MAX_FILE_BYTES,
    max_prompt_bytes: MaxPromptBytesOpt = None,
    allowed_hosts: AllowedHostsOpt = None,
    served_model_name: Annotated[
        str | None,
        typer.Option(
            help="Triton model name of MODEL or of the default model (default: quanta; "
            "ensemble for TensorRT-LLM clients)"
        ),
    ] = None,
    policy: Annotated[
        str | None, typer.Option(help="scheduling policy, e.g. fcfs, sj-mlfq, fair+sj-mlfq")
    ] = None,
    policy_option: PolicyOpt = None,
    state_url: Annotated[
        str | None,
        typer.Option(
            help="redis://HOST:PORT/DB: the fair policies' counters, windows and interactions "
            "shared with every replica naming it (the policy option state_url)"
        ),
    ] = None,
    dtype: Annotated[str | None, typer.Option(help="float32, bfloat16 or float16")] = None,
    device: Annotated[str | None, typer.Option(help="cpu, cuda or cuda:N")] = None,
    linear_kernel: Annotated[
        LinearKernelOpt | None,
        typer.Option(help="projections: auto, native (bf16 panel kernel), onednn or torch"),
    ] = None,
    attention_kernel: Annotated[
        AttentionKernelOpt | None,
        typer.Option(help="decode attention: auto, native (C, built at load), compiled or eager"),
    ] = None,
    safepoint_interval: Annotated[
        int | None,
        typer.Option(min=1, help="layers between abort checks of a preemptible step (8)"),
    ] = None,
    max_num_seqs: Annotated[int | None, typer.Option(min=1, help="sequences per step")] = None,
    max_num_batched_tokens: Annotated[
        int | None, typer.Option(min=1, help="tokens per step")
    ] = None,
    max_seq_len: Annotated[
        int | None, typer.Option(min=1, help="longest prompt + output of a request")
    ] = None,
    block_size: Annotated[int | None, typer.Option(min=1, help="tokens per KV block")] = None,
    enable_prefix_caching: PrefixCachingOverrideOpt = None,
    speculative_config: SpeculativeConfigOpt = None,
    tensor_parallel_size: TensorParallelOpt = None,
    kv_cache_memory: Annotated[
        str | None, typer.Option(help="device KV tier, e.g. 4GiB (default: the engine's)")
    ] = None,
    host_cache_memory: Annotated[
        str | None, typer.Option(help="host tier for swapped KV, e.g. 8GiB")
    ] = None,
    torch_threads: Annotated[
        int | None, typer.Option(min=1, help="CPU threads of the engine (default: torch's)")
    ] = None,
    io_layout: Annotated[
        str | None,
        typer.Option(
            help="quanta (scalars are [1]) or tensorrt_llm (TensorRT-LLM's tensors: a batch "
            "dimension, prompt echo by default; with --served-model-name ensemble, a drop-in)"
        ),
    ] = None,
    drain_timeout: Annotated[
        float,
        typer.Option(
            min=0,
            help="on Ctrl-C or SIGTERM, seconds in-flight requests get to finish while new "
            "ones are refused (503); 0: end them at once",
        ),
    ] = 30.0,
    max_restarts: Annotated[
        int,
        typer.Option(
            min=0,
            help="restarts of a tritonserver that dies: 0 restarts it forever; N gives up "
            "(exits with its status) after N restarts in a row (5 minutes up resets the count)",
        ),
    ] = 0,
    max_restart_delay: Annotated[
        float,
        typer.Option(
            min=0,
            help="the longest wait before a restart (the wait doubles from 1 s with each "
            "death in a row, jittered, up to this)",
        ),
    ] = 30.0,
    replicas: Annotated[
        int,
        typer.Option(
            min=1,
            help="tritonservers of the same model on this machine, replica i on the ports "
            "plus 10*i; with --openai-port the gateway routes to all of them",
        ),
    ] = 1,
    router: Annotated[
        RouterOpt, typer.Option(help="how the gateway picks a replica (with --replicas)")
    ] = RouterOpt.least_outstanding,
) -> None:
    """Serve MODEL, or the model repository, through tritonserver (HTTP, gRPC, metrics)."""
    from quanta.frontends.openai.server import model_dir_from_repository
    from quanta.frontends.triton.check import check_path
    from quanta.frontends.triton.launcher import LaunchError, ServerOptions, TritonServer
    from quanta.frontends.triton.model_entry import EntryError, served_parameters, write_entry
    from quanta.frontends.triton.repository import DEFAULT_MODEL_NAME, write_model_repository
    from quanta.frontends.triton.supervise import drain_all, supervise_all

    options = parse_options(policy_option) if policy_option else None
    if state_url is not None:
        options = {**(options or {}), "state_url": state_url}
        check_state_policy(policy, options)
    keys = api_key_policies(api_key, api_key_file)
    if keys and openai_port is None:
        raise typer.BadParameter("API keys guard the OpenAI gateway: give --openai-port too")
    options = with_key_weights(policy, options, keys)  # a key's weight is its tenant's share
    gateway_options: dict[str, Any] = {
        "api_keys": keys,
        "max_request_bytes": max_request_bytes,
        "max_file_bytes": max_file_bytes,
        "max_model_len": max_seq_len,
        "max_prompt_bytes": max_prompt_bytes,
        "allowed_hosts": tuple(allowed_hosts or ()),
    }
    try:
        flags = served_parameters(
            policy=policy,
            policy_options=options,
            dtype=dtype,
            device=device,
            linear_kernel=None if linear_kernel is None else linear_kernel.value,
            attention_kernel=None if attention_kernel is None else attention_kernel.value,
            safepoint_interval=safepoint_interval,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_seq_len=max_seq_len,
            block_size=block_size,
            enable_prefix_caching=enable_prefix_caching,
            speculative_config=parse_speculative_config(speculative_config),
            tensor_parallel_size=tensor_parallel_size,
            kv_cache_memory=kv_cache_memory,
            host_cache_memory=host_cache_memory,
            torch_threads=torch_threads,
            io_layout=io_layout,
        )
    except EntryError as exc:
        raise typer.BadParameter(str(exc)) from None
    with tempfile.TemporaryDirectory(prefix="quanta-models-") as tmp:
        repo = model_repository
        served = served_model_name or DEFAULT_MODEL_NAME
        if model is not None:
            if model_repository is not None:
                raise typer.BadParameter("give MODEL or --model-repository, not both")
            model = resolve_model(model, dtype)
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
            if flags or served_model_name:
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
        if replicas > 1 and demo is not None:
            raise typer.BadParameter("--demo runs one server: leave out --replicas")
        options = ServerOptions(
            model_repository=repo,
            host=triton_host,
            http_port=http_port,
            grpc_port=grpc_port,
            metrics_port=metrics_port,
            tritonserver=tritonserver,
            backend_dir=backend_dir,
            log_verbose=log_verbose,
            admin_key=triton_admin_key,
        )
        servers = [
            TritonServer(options.replica(i), log_file=_replica_log(log_file, i))
            for i in range(replicas)
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
                s.wait_ready(ready_timeout)
                label = f" (replica {i})" if replicas > 1 else ""
                typer.echo(f"HTTP    {s.http_url}{label}")
                typer.echo(f"gRPC    {s.grpc_url}{label}")
                typer.echo(f"metrics {s.metrics_url}{label}")
            if openai_port is not None:
                gateway = _start_gateway(
                    servers,
                    repo,
                    host,
                    openai_port,
                    model_name,
                    state_dir,
                    router.value,
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
            if gateway is not None and host != triton_host:
                typer.echo(f"Triton's ports stay on {triton_host}, behind the gateway")
            elif gateway is None and host != triton_host:
                typer.echo(
                    f"note: --host {host} binds the OpenAI gateway, which --openai-port starts; "
                    f"Triton's ports bind {triton_host} (--triton-host)",
                    err=True,
                )
            typer.echo("ready; Ctrl-C stops the server" + ("s" if replicas > 1 else ""))
            code = supervise_all(servers, max_restarts, ready_timeout, max_restart_delay)
            if code != 0:
                raise typer.Exit(code)
        except LaunchError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(1) from None
        except KeyboardInterrupt:
            drain_all(servers, drain_timeout)
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
    from quanta.frontends.openai.server import (
        GatewayError,
        model_dir_from_repository,
        start_gateway,
    )
    from quanta.frontends.triton.launcher import LaunchError, free_port

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
    from quanta.frontends.openai.chat import ChatTemplate
    from quanta.frontends.openai.protocol import ChatMessage
    from quanta.frontends.triton.client import generate

    template = ChatTemplate.from_model_dir(model_dir) if model_dir is not None else None
    text = prompt
    if template is not None and template.has_own_template:
        text = template.render([ChatMessage(role="user", content=prompt)])
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
