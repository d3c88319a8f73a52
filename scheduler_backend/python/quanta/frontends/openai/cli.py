"""``quanta openai``: the OpenAI-compatible gateway in front of an already running Triton.

(``quanta serve --openai-port N`` starts the same gateway next to the Triton it launches.)
Imports of FastAPI, uvicorn and tritonclient happen inside the command.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from quanta.cli_options import (
    AllowedHostsOpt,
    ApiKeyFileOpt,
    ApiKeyOpt,
    MaxFileBytesOpt,
    MaxPromptBytesOpt,
    MaxRequestBytesOpt,
    RouterOpt,
    api_key_policies,
)
from quanta.frontends.openai.limits import DEFAULT_MAX_FILE_BYTES, DEFAULT_MAX_REQUEST_BYTES


def register(app: typer.Typer, bench_app: typer.Typer) -> None:
    """Add ``openai`` to the main app."""
    app.command("openai")(openai)


def openai(
    triton_grpc_url: Annotated[
        str, typer.Option(help="Triton's gRPC endpoint, host:port")
    ] = "127.0.0.1:8001",
    host: Annotated[str, typer.Option(help="address the gateway binds to")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="gateway HTTP port")] = 9000,
    model_name: Annotated[
        str, typer.Option(help="model name clients use (and Triton's)")
    ] = "quanta",
    triton_model: Annotated[
        str | None, typer.Option(help="the model's name in Triton, if not --model-name")
    ] = None,
    model_dir: Annotated[
        Path | None,
        typer.Option(help="checkpoint dir whose tokenizer_config.json chat_template to use"),
    ] = None,
    chat_template: Annotated[
        Path | None, typer.Option(help="a jinja2 chat template file (overrides --model-dir's)")
    ] = None,
    default_chat_max_tokens: Annotated[
        int, typer.Option(min=1, help="max_tokens of a chat request that gives none")
    ] = 256,
    request_timeout: Annotated[
        float | None, typer.Option(help="seconds a request may take in Triton")
    ] = None,
    state_dir: Annotated[
        Path, typer.Option(help="where Batch API files and batches are kept (survive restarts)")
    ] = Path("quanta-state"),
    batch_concurrency: Annotated[
        int, typer.Option(min=1, help="batch requests in flight at once, over all batches")
    ] = 64,
    upstream: Annotated[
        list[str] | None,
        typer.Option(
            help="a Triton replica's gRPC endpoint, host:port; repeat for several (replaces "
            "--triton-grpc-url; docs/scale-out.md)"
        ),
    ] = None,
    router: Annotated[
        RouterOpt, typer.Option(help="how requests pick a replica (with --upstream)")
    ] = RouterOpt.least_outstanding,
    api_key: ApiKeyOpt = None,
    api_key_file: ApiKeyFileOpt = None,
    max_request_bytes: MaxRequestBytesOpt = DEFAULT_MAX_REQUEST_BYTES,
    max_file_bytes: MaxFileBytesOpt = DEFAULT_MAX_FILE_BYTES,
    max_model_len: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="the model's context length, for the prompt limit (default: --model-dir's "
            "config.json)",
            show_default=False,
        ),
    ] = None,
    max_prompt_bytes: MaxPromptBytesOpt = None,
    allowed_hosts: AllowedHostsOpt = None,
) -> None:
    """Serve /v1/completions, /v1/chat/completions, /v1/models and the Batch API (/v1/files,
    /v1/batches), forwarding to Triton gRPC; with --api-key or --api-key-file every route but
    /health and /metrics needs a key."""
    from quanta.frontends.openai.app import GatewaySettings
    from quanta.frontends.openai.chat import ChatTemplate
    from quanta.frontends.openai.server import GatewayServer

    keys = api_key_policies(api_key, api_key_file)
    template = (
        ChatTemplate.from_file(chat_template)
        if chat_template is not None
        else ChatTemplate.from_model_dir(model_dir)
    )
    settings = GatewaySettings(
        triton_grpc_url=triton_grpc_url,
        model_name=model_name,
        triton_model=triton_model,
        default_chat_max_tokens=default_chat_max_tokens,
        request_timeout_s=request_timeout,
        state_dir=state_dir,
        batch_concurrency=batch_concurrency,
        upstreams=tuple(upstream or ()),
        router=router.value,
        api_keys=keys,
        max_request_bytes=max_request_bytes,
        max_file_bytes=max_file_bytes,
        max_model_len=max_model_len,
        max_prompt_bytes=max_prompt_bytes,
        allowed_hosts=tuple(allowed_hosts or ()),
    )
    target = ", ".join(upstream) + f" ({router.value})" if upstream else triton_grpc_url
    typer.echo(f"OpenAI  http://{host}:{port}/v1 -> Triton gRPC {target}")
    if keys:
        tenants = sorted({p.tenant for p in keys.values()})
        typer.echo(f"API keys: {len(keys)}, tenants: {', '.join(tenants)}")
        if any(p.weight != 1.0 for p in keys.values()):
            typer.echo(
                "note: key weights reach a running Triton only through its model's policy "
                "options (weights for vtc, priorities for fair/wsc); quanta serve sets them"
            )
    GatewayServer(settings, host=host, port=port, chat_template=template, log_level="info").run()
