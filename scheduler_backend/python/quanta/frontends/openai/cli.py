"""``quanta openai``: the OpenAI-compatible gateway in front of an already running Triton.

(``quanta serve --openai-port N`` starts the same gateway next to the Triton it launches.)
Imports of FastAPI, uvicorn and tritonclient happen inside the command.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from quanta.cli_options import api_key_policies
from quanta.config.cli import env_prefix, options_from
from quanta.config.models import ServingArgs
from quanta.core.pooling import PoolingParams


def register(app: typer.Typer, bench_app: typer.Typer) -> None:
    """Add ``openai`` to the main app."""
    app.command("openai", context_settings=env_prefix("openai"))(openai)


@options_from(
    serving=ServingArgs,
    only={
        "serving": (
            "host",
            "state_dir",
            "router",
            "api_key",
            "api_key_file",
            "max_request_bytes",
            "max_file_bytes",
            "max_prompt_bytes",
            "allowed_hosts",
            "tool_call_parser",
            "pooler_config",
        )
    },
)
def openai(
    triton_grpc_url: Annotated[
        str, typer.Option(help="Triton's gRPC endpoint, host:port")
    ] = "127.0.0.1:8001",
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
    max_model_len: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="the model's context length, for the prompt limit (default: --model-dir's "
            "config.json)",
            show_default=False,
        ),
    ] = None,
    *,
    serving: ServingArgs,
) -> None:
    """Serve /v1/completions, /v1/chat/completions, /v1/models and the Batch API (/v1/files,
    /v1/batches), forwarding to Triton gRPC; with --api-key or --api-key-file every route but
    /health and /metrics needs a key."""
    from quanta.frontends.openai.app import GatewaySettings
    from quanta.frontends.openai.server import GatewayServer
    from quanta.text.chat_template import ChatTemplate, ChatTemplateLoadError

    keys = api_key_policies(serving.api_key, serving.api_key_file)
    try:
        template = (
            ChatTemplate.from_file(chat_template)
            if chat_template is not None
            else ChatTemplate.from_model_dir(model_dir)
        )
    except ChatTemplateLoadError as exc:
        hint = "--chat-template" if chat_template is not None else "--model-dir"
        raise typer.BadParameter(str(exc), param_hint=hint) from None
    settings = GatewaySettings(
        triton_grpc_url=triton_grpc_url,
        model_name=model_name,
        triton_model=triton_model,
        default_chat_max_tokens=default_chat_max_tokens,
        request_timeout_s=request_timeout,
        state_dir=serving.state_dir,
        batch_concurrency=batch_concurrency,
        upstreams=tuple(upstream or ()),
        router=serving.router,
        api_keys=keys,
        max_request_bytes=serving.max_request_bytes,
        max_file_bytes=serving.max_file_bytes,
        max_model_len=max_model_len,
        max_prompt_bytes=serving.max_prompt_bytes,
        allowed_hosts=tuple(serving.allowed_hosts or ()),
        pooler_config=serving.pooler_config or PoolingParams(),
        tool_call_parser=serving.tool_call_parser,
    )
    target = ", ".join(upstream) + f" ({serving.router})" if upstream else triton_grpc_url
    typer.echo(f"OpenAI  http://{serving.host}:{port}/v1 -> Triton gRPC {target}")
    if keys:
        tenants = sorted({p.tenant for p in keys.values()})
        typer.echo(f"API keys: {len(keys)}, tenants: {', '.join(tenants)}")
        if any(p.weight != 1.0 for p in keys.values()):
            typer.echo(
                "note: key weights reach a running Triton only through its model's policy "
                "options (weights for vtc, priorities for fair/wsc); quanta serve sets them"
            )
    GatewayServer(
        settings, host=serving.host, port=port, chat_template=template, log_level="info"
    ).run()
