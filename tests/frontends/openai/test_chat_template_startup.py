"""The gateway loads its chat template when it starts: a template it cannot render stops the
start with the template's source and jinja's error, while a template that only refuses some
conversations (Gemma 2's system role) loads and answers those with the usual 400."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest
from family_chat_templates import GEMMA2
from quanta.cli import app
from quanta.frontends.openai.server import GatewayError, start_gateway
from quanta.frontends.triton.launcher import free_port
from typer.testing import CliRunner

MODEL = "quanta"
BROKEN = "{% for m in messages %}{{ m.content | no_such_filter }}{% endfor %}"


def checkpoint(directory: Path, template: str) -> Path:
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": template, "bos_token": "<bos>", "eos_token": "<eos>"})
    )
    return directory


def gateway(model_dir: Path):
    return start_gateway(
        f"127.0.0.1:{free_port()}",
        host="127.0.0.1",
        port=free_port(),
        model_name=MODEL,
        model_dir=model_dir,
    )


def test_serve_with_a_template_it_cannot_render_does_not_start(tmp_path):
    with pytest.raises(GatewayError) as info:
        gateway(checkpoint(tmp_path, BROKEN))
    assert str(tmp_path / "tokenizer_config.json") in str(info.value)
    assert "No filter named 'no_such_filter'" in str(info.value)


def test_openai_command_names_the_template_it_cannot_render(tmp_path):
    template = tmp_path / "chat.jinja"
    template.write_text("{% if add_generation_prompt %}<|assistant|>")
    result = CliRunner().invoke(
        app, ["openai", "--port", str(free_port()), "--chat-template", str(template)]
    )
    assert result.exit_code == 2
    assert "--chat-template" in result.output and "does not compile" in result.output
    assert "Unexpected end of template" in result.output


def test_a_template_that_refuses_a_system_turn_loads_and_refuses_it_with_400(tmp_path):
    server = gateway(checkpoint(tmp_path, GEMMA2))
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="-", max_retries=0)
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(
                model=MODEL,
                messages=[
                    {"role": "system", "content": "Be terse."},
                    {"role": "user", "content": "Hi"},
                ],
                max_tokens=2,
            )
        error = info.value.response.json()["error"]
        assert error["message"] == "chat template: System role not supported"
        assert error["param"] == "messages"
        # a conversation it accepts is rendered and goes on to Triton (absent here: 503)
        with pytest.raises(openai.InternalServerError) as unreachable:
            client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2
            )
        assert unreachable.value.status_code == 503
    finally:
        client.close()
        server.stop()
