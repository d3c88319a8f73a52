"""Triton's admin protocols need Quanta's admin key: `quanta serve` starts tritonserver with
``--http-restricted-api``/``--grpc-restricted-protocol`` for model-repository, logging,
trace, shared-memory and statistics, so a client without the key cannot change logging or
unload the model, while inference, health, metadata and model config stay open and the
server still loads, serves and drains as before. Its ports bind the loopback unless
``--triton-host`` says otherwise."""

from __future__ import annotations

import json
import os
import shlex
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from quanta import SamplingParams
from quanta.frontends.triton.client import http_events, request_inputs
from quanta.frontends.triton.launcher import (
    ADMIN_KEY_HEADER,
    GRPC_ADMIN_KEY_HEADER,
    free_port,
)
from serving import Background

pytestmark = [pytest.mark.live]

KEY = "test-admin-key-0123456789"


def _request(url: str, body: dict | None, headers: dict[str, str]) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        url, data=data, headers={"Content-Type": "application/json", **headers}
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def test_admin_apis_need_the_key_and_serving_and_draining_do_not(opt_tiny: Path, tmp_path):
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    ports = {name: free_port() for name in ("http", "grpc", "metrics", "openai")}
    cmd = [sys.executable, "-m", "quanta.cli", "serve", str(opt_tiny)]
    cmd += [arg for name, port in ports.items() for arg in (f"--{name}-port", str(port))]
    cmd += ["--log-file", str(tmp_path / "triton.log"), "--host", "127.0.0.1"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "QUANTA_TRITON_ADMIN_KEY": KEY}
    srv = Background(shlex.join(cmd), tmp_path, env)
    http = f"http://127.0.0.1:{ports['http']}"
    try:
        srv.wait_for_line("ready", timeout=180)
        assert f"HTTP    {http}" in "".join(srv.lines)  # Triton on the loopback
        level = {"log_verbose_level": 0}
        for path, body in [("/v2/logging", level), ("/v2/trace/setting", {})]:
            status, answer = _request(http + path, body, {})
            assert status == 403, (path, answer)
            assert ADMIN_KEY_HEADER in answer["error"]
            assert _request(http + path, body, {ADMIN_KEY_HEADER: "wrong"})[0] == 403
            assert _request(http + path, body, {ADMIN_KEY_HEADER: KEY})[0] == 200
        assert _request(f"{http}/v2/repository/models/quanta/unload", {}, {})[0] == 403
        assert _request(f"{http}/v2/models/quanta/stats", None, {})[0] == 403
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{ports['grpc']}")
        with pytest.raises(InferenceServerException, match="restricted"):
            client.get_log_settings()
        assert client.get_log_settings(headers={GRPC_ADMIN_KEY_HEADER: KEY}) is not None
        # what stays open: health, metadata, config, inference
        assert client.is_model_ready("quanta")
        assert client.get_model_config("quanta") is not None
        params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
        inputs = request_inputs("hi", params, stream=False)
        events = list(http_events(http, "quanta", inputs, stream=False))
        assert events[-1]["finish_reason"] == "length"
        client.close()
    finally:
        code = srv.stop()
    out = "".join(srv.lines)
    assert code == 0, out
    assert "drained" in out
