"""``quanta generate --model``: the chat template when the checkpoint has one, ``--raw``
without it, and an empty answer said so on stderr (the ``--url`` side is in
``triton/test_triton_server.py``)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import quanta
from quanta import SamplingParams
from quanta.cli import app
from quanta.text.chat_template import ChatTemplate, Turn
from typer.testing import CliRunner

pytestmark = pytest.mark.engine

TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
TOKENS = 8


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory: pytest.TempPathFactory, opt_tiny: Path) -> Path:
    """The tiny checkpoint with a chat template of its own."""
    root = tmp_path_factory.mktemp("chat") / "opt-tiny-chat"
    shutil.copytree(opt_tiny, root)
    path = root / "tokenizer_config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    path.write_text(json.dumps(config | {"chat_template": TEMPLATE}))
    return root


def greedy(model: Path, prompt: str) -> str:
    with quanta.LLM(str(model)) as llm:
        return llm.generate(prompt, SamplingParams(max_tokens=TOKENS, temperature=0.0))[0].text


def run(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(app, ["generate", *args, "--max-tokens", str(TOKENS)])
    return result.exit_code, result.stdout, result.stderr


def test_a_base_model_continues_the_text(opt_tiny):
    code, out, err = run("--model", str(opt_tiny), "Hello")
    assert code == 0, err
    assert out == greedy(opt_tiny, "Hello") + "\n"


def test_a_chat_model_answers_in_its_template_and_raw_sends_the_text(chat_model):
    rendered = ChatTemplate.from_model_dir(chat_model).render([Turn("user", "Hello")])
    assert rendered == "<|user|>Hello\n<|assistant|>"
    code, out, err = run("--model", str(chat_model), "Hello")
    assert code == 0, err
    assert out == greedy(chat_model, rendered) + "\n"
    code, out, err = run("--model", str(chat_model), "--raw", "Hello")
    assert code == 0, err
    assert out == greedy(chat_model, "Hello") + "\n"


def test_an_empty_answer_is_said_so_and_exits_0(opt_tiny):
    """A stop string at the answer's first character leaves nothing: stdout has the empty
    line, stderr says why, and the status is 0 (the model answered)."""
    first = greedy(opt_tiny, "Hello")[:1]
    assert first
    code, out, err = run("--model", str(opt_tiny), "--stop", first, "Hello")
    assert code == 0
    assert out == "\n"
    assert "the answer is empty" in err and "raw text" in err


def test_model_dir_goes_with_url(opt_tiny):
    code, _, err = run("--model", str(opt_tiny), "--model-dir", str(opt_tiny), "Hello")
    assert code == 2
    assert "--model-dir goes with --url" in err


def test_a_template_that_cannot_run_is_a_clear_error_not_a_traceback(tmp_path, opt_tiny):
    model = tmp_path / "broken-template"
    shutil.copytree(opt_tiny, model)
    path = model / "tokenizer_config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    path.write_text(json.dumps(config | {"chat_template": "{% for m in messages %}{{ m.content "}))
    code, out, err = run("--model", str(model), "Hello")
    assert code == 1
    assert err.startswith("error: ") and "--raw" in err
    assert "Traceback" not in err + out
    code, _, err = run("--model", str(model), "--raw", "Hello")
    assert code == 0, err
