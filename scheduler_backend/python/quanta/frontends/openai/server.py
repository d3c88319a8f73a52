"""Run the gateway with uvicorn: on a background thread (next to tritonserver) or in front.

Why a thread is enough inside ``quanta serve``: the gateway only relays bytes between two
sockets on an asyncio loop, so it costs the process little, and stopping it is setting uvicorn's
``should_exit`` and joining. uvicorn installs signal handlers only on the main thread, so Ctrl-C
still reaches ``quanta serve``, which stops the gateway and then Triton.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

from quanta.frontends.openai.app import GatewaySettings, auth_warning, create_app
from quanta.frontends.openai.upstream import TritonGrpc
from quanta.text.chat_template import ChatTemplate, ChatTemplateLoadError


class GatewayError(RuntimeError):
    """The gateway could not start (port taken, bad settings)."""


class GatewayServer:
    """uvicorn serving ``create_app(settings)`` on ``host:port``."""

    def __init__(
        self,
        settings: GatewaySettings,
        *,
        host: str = "127.0.0.1",
        port: int = 9000,
        chat_template: ChatTemplate | None = None,
        log_level: str = "warning",
        upstream: TritonGrpc | None = None,
    ) -> None:
        import uvicorn

        self.host, self.port = host, port
        app = create_app(settings, chat_template, upstream=upstream)
        config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False)
        self._server = uvicorn.Server(config)
        warning = auth_warning(settings, host)
        if warning is not None:  # NOTE: uvicorn.Config has set up its loggers by now
            logging.getLogger("uvicorn.error").warning(warning)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def run(self) -> None:
        """Serve in the foreground until Ctrl-C (uvicorn handles the signal)."""
        self._server.run()

    def start(self, timeout: float = 30.0) -> GatewayServer:
        """Serve on a daemon thread; return once the socket listens."""
        self._thread = threading.Thread(target=self._serve, name="quanta-openai", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise GatewayError(f"the OpenAI gateway did not start on {self.url}: {self._error}")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Finish open responses (up to ``timeout``), close the socket; idempotent."""
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                self._server.force_exit = True
                self._thread.join(timeout)
            self._thread = None

    def _serve(self) -> None:
        try:
            self._server.run()
        except BaseException as exc:  # SystemExit when the port is taken
            self._error = exc


def start_gateway(
    triton_grpc_url: str,
    *,
    host: str,
    port: int,
    model_name: str,
    model_dir: Path | None = None,
    **settings: Any,
) -> GatewayServer:
    """Start a gateway thread for ``quanta serve``; the chat template comes from ``model_dir``
    (one it cannot render is a ``GatewayError`` here, not a wrong prompt later)."""
    try:
        template = ChatTemplate.from_model_dir(model_dir)
    except ChatTemplateLoadError as exc:
        raise GatewayError(str(exc)) from None
    gateway = GatewayServer(
        GatewaySettings(triton_grpc_url=triton_grpc_url, model_name=model_name, **settings),
        host=host,
        port=port,
        chat_template=template,
    )
    return gateway.start()
