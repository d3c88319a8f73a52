"""GGUF import: a llama.cpp-layout file becomes the engine its HF checkpoint would give.

Each GGUF here is written from a known tiny checkpoint (``gguf_helpers``), so the test knows
every weight a correct reader must recover: q/k rows back in HF's order, quantized tensors
dequantized, the tokenizer and chat template rebuilt from metadata. The engine built from the
GGUF must then answer exactly as the engine built from the checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
from quanta.build.checkpoint import make_checkpoint
from quanta.build.engine_build import BuildOptions, build_engine_dir
from quanta.build.gguf_export import permute_rope_rows, write_gguf
from quanta.build.gguf_import import gguf_to_checkpoint, unpermute_rope_rows
from quanta.build.manifest import read_manifest
from quanta.build.steps import BuildError
from quanta.core.request import SamplingParams
from quanta.frontends.offline import LLM
from quanta.frontends.openai.protocol import ChatMessage
from quanta.text.chat_template import ChatTemplate
from quanta.text.tokenizer import load_tokenizer
from safetensors.numpy import load_file

Q = gguf.GGMLQuantizationType
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
TEXTS = ["Hello, world!", "The quick brown fox 12345", "  two spaces\nand a line", "é ü 日本"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_checkpoint("llama-tiny", tmp_path_factory.mktemp("ck") / "llama-tiny", seed=5)


def test_rope_row_permutation_round_trips():
    rows = np.arange(4 * 8 * 3, dtype=np.float32).reshape(4 * 8, 3)
    for heads in (1, 2, 4):
        permuted = permute_rope_rows(rows, heads)
        assert not np.array_equal(permuted, rows)
        assert np.array_equal(unpermute_rope_rows(permuted, heads), rows)


@pytest.mark.parametrize("qtype", [Q.F32, Q.Q8_0, Q.Q4_1])
def test_import_recovers_every_weight(checkpoint, tmp_path, qtype):
    path = tmp_path / "m.gguf"
    expected = write_gguf(checkpoint, path, qtype=qtype, chat_template=TEMPLATE)
    out = tmp_path / "hf"
    out.mkdir()
    summary = gguf_to_checkpoint(path, out)
    got = load_file(str(out / "model.safetensors"))
    assert set(got) == set(expected)
    for name, array in expected.items():
        assert np.array_equal(got[name], array), name
    if qtype != Q.F32:
        assert summary.tensor_types[qtype.name] > 0
        assert qtype.name in summary.quantization
    config = json.loads((out / "config.json").read_text())
    original = json.loads((checkpoint / "config.json").read_text())
    for key in ("hidden_size", "num_hidden_layers", "num_key_value_heads", "rms_norm_eps"):
        assert config[key] == original[key], key
    assert config["tie_word_embeddings"] is False  # the file stores output.weight


def test_tokenizer_and_template_come_from_the_metadata(checkpoint, tmp_path):
    path = tmp_path / "m.gguf"
    write_gguf(checkpoint, path, chat_template=TEMPLATE)
    out = tmp_path / "hf"
    out.mkdir()
    gguf_to_checkpoint(path, out)
    ours, theirs = load_tokenizer(out), load_tokenizer(checkpoint)
    assert ours.bos_token_id == theirs.bos_token_id and ours.eos_token_id == theirs.eos_token_id
    for text in TEXTS:
        assert ours.encode(text) == theirs.encode(text), text
        assert ours.decode(ours.encode(text)) == theirs.decode(theirs.encode(text))
    template = ChatTemplate.from_model_dir(out)
    assert template.has_own_template
    assert (
        template.render([ChatMessage(role="user", content="hi")]) == "<|user|>hi</s><|assistant|>"
    )


@pytest.mark.engine
def test_engine_from_gguf_answers_as_the_checkpoints_engine(checkpoint, tmp_path):
    path = tmp_path / "m.gguf"
    write_gguf(checkpoint, path, chat_template=TEMPLATE)
    options = BuildOptions(dtype="float32", kv_cache_memory=1 << 20, host_cache_memory=0)
    from_gguf = build_engine_dir(path, tmp_path / "from-gguf", options)
    from_hf = build_engine_dir(checkpoint, tmp_path / "from-hf", options)
    assert from_gguf.source.format == "gguf" and from_hf.source.format == "hf"
    assert from_gguf.source.files == {"m.gguf": from_gguf.source.sha256}
    assert from_gguf.source.quantization is not None and "F32" in from_gguf.source.quantization
    assert read_manifest(tmp_path / "from-gguf") == from_gguf
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no leftovers
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    answers = [
        [r.token_ids for r in LLM(str(tmp_path / d), dtype="float32").generate(TEXTS, params)]
        for d in ("from-gguf", "from-hf")
    ]
    assert answers[0] == answers[1]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"arch": "gpt2"}, "GGUF architecture 'gpt2' is not supported"),
        ({"tokenizer_model": "bert"}, "GGUF tokenizer model 'bert' is not supported"),
        ({"pre": "chatglm-bpe"}, "GGUF pre-tokenizer 'chatglm-bpe' is not supported"),
    ],
)
def test_what_cannot_be_read_is_named(checkpoint, tmp_path, kwargs, message):
    path = tmp_path / "m.gguf"
    write_gguf(checkpoint, path, **kwargs)
    with pytest.raises(BuildError, match=message):
        build_engine_dir(path, tmp_path / "engine", BuildOptions(dtype="float32"))
    assert not (tmp_path / "engine").exists()


def test_a_refused_gguf_build_names_the_file_it_was_given(checkpoint, tmp_path):
    """Errors found after the file was unpacked name the GGUF file, not the directory it was
    unpacked into (which is gone when the user reads the message)."""
    path = tmp_path / "m.gguf"
    write_gguf(checkpoint, path)
    with pytest.raises(BuildError) as refused:
        build_engine_dir(path, tmp_path / "engine", BuildOptions(quantization="keep"))
    assert str(refused.value).startswith(f"{path}: --quantization keep needs a GGUF file")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    bogus = tmp_path / "m.gguf"
    bogus.write_bytes(b"not a gguf file at all")
    with pytest.raises(BuildError, match="not a readable GGUF file"):
        build_engine_dir(bogus, tmp_path / "engine", BuildOptions(dtype="float32"))


@pytest.mark.engine
def test_a_transformers_5_checkpoint_with_rope_parameters_loads(tmp_path):
    """transformers 5.x writes ``rope_parameters`` where 4.x wrote ``rope_theta`` and
    ``rope_scaling``; the loader reads both, so a checkpoint 5.x saved answers as HF does."""
    import torch
    from quanta.runner import ModelRunner
    from runner_helpers import build_hf_checkpoint

    hf = build_hf_checkpoint(
        "llama",
        tmp_path / "ck",
        seed=2,
        rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 5000.0},
    )
    raw = json.loads((tmp_path / "ck" / "config.json").read_text())
    if "rope_parameters" not in raw:
        pytest.skip("the installed transformers writes the 4.x layout")
    assert "rope_theta" not in raw and "rope_scaling" not in raw
    runner = ModelRunner(tmp_path / "ck", num_device_blocks=16, num_host_blocks=0, dtype="float32")
    prompt = list(range(3, 90))
    with torch.no_grad():
        want = hf(torch.tensor([prompt])).logits[0]
    assert (runner.forward_logits(prompt) - want).abs().max().item() < 1e-4


@pytest.mark.engine
@pytest.mark.parametrize("qtype", [Q.F32, Q.Q8_0])
def test_import_agrees_with_transformers_own_gguf_reader(checkpoint, tmp_path, qtype):
    """transformers dequantizes and un-permutes a GGUF file with code of its own: an
    independent reading of the same bytes."""
    pytest.importorskip("accelerate", reason="transformers reads GGUF only with accelerate")
    import torch
    from transformers import AutoModelForCausalLM

    path = tmp_path / "m.gguf"
    write_gguf(checkpoint, path, qtype=qtype)
    out = tmp_path / "hf"
    out.mkdir()
    gguf_to_checkpoint(path, out)
    ours = load_file(str(out / "model.safetensors"))
    theirs = AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=path.name, dtype=torch.float32
    ).state_dict()
    for name, array in ours.items():
        assert np.array_equal(theirs[name].numpy(), array), name
