"""GGUF files of the kit's families (Qwen2, Qwen3, Mistral, Phi-3, Gemma 2) read as HF
reads them.

Each file is written by the ``gguf`` package's writer from a random-weight checkpoint that
transformers itself wrote from the family's config. The import must recover exactly the
weights transformers' own GGUF reader recovers from the same bytes, and the engine built from
it must give the logits of the HF model the file came from. The tokenizers the files carry
(byte-level BPE under llama.cpp's pre-tokenizer names) must split text as transformers'
GGUF tokenizer does.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from quanta.build.engine_build import BuildOptions, build_engine_dir
from quanta.build.gguf_export import write_gguf
from quanta.build.gguf_import import gguf_to_checkpoint
from quanta.build.quantization import write_dequantized
from quanta.build.steps import BuildError
from quanta.build.tokenizer import special_token_ids, write_tokenizer
from quanta.core.request import SamplingParams
from quanta.frontends.offline import LLM
from quanta.runner import ModelRunner
from quanta.text.tokenizer import load_tokenizer
from runner_helpers import widen_weights
from safetensors.numpy import load_file

pytest.importorskip("accelerate", reason="transformers reads GGUF only with accelerate")

Q = gguf.GGMLQuantizationType
WINDOW = 8
COMMON = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "max_position_embeddings": 256,
}
# transformers' GGUF reader takes head_dim from the file only for Gemma, and no
# query_pre_attn_scalar at all (llama.cpp scales by head_dim): it is handed these overrides.
FAMILIES: dict[str, dict[str, Any]] = {
    "qwen2": {},
    "qwen3": {"head_dim": 16},
    "mistral": {"head_dim": 16, "sliding_window": None},  # stored as the llama architecture
    "phi3": {},
    "gemma2": {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": WINDOW},
}
TEXTS = ["Hello, world!", "The quick brown fox 12345", "  two spaces\nand a line", "é ü 日本"]


def _checkpoint(model_type: str, path: Path, seed: int, **extra: Any) -> Any:
    """A tiny random fp32 model written by transformers, with a byte-level BPE tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path.mkdir(parents=True)
    tokenizer = write_tokenizer("llama", path, COMMON["max_position_embeddings"])
    ids = special_token_ids("llama")
    config = AutoConfig.for_model(
        model_type,
        vocab_size=tokenizer.get_vocab_size(),
        bos_token_id=ids["bos_token_id"],
        eos_token_id=ids["eos_token_id"],
        pad_token_id=ids.get("pad_token_id") or 0,
        **COMMON,
        **(FAMILIES.get(model_type, {}) | extra),
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    widen_weights(model)
    model.save_pretrained(path, safe_serialization=True)
    return model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    root = tmp_path_factory.mktemp("families")
    return {
        name: (root / name, _checkpoint(name, root / name, seed=i))
        for i, name in enumerate(FAMILIES)
    }


def _import(checkpoint: Path, tmp_path: Path, qtype: Q = Q.F32, **kw: Any) -> tuple[Path, Path]:
    path = tmp_path / "m.gguf"
    write_gguf(checkpoint, path, qtype=qtype, **kw)
    out = tmp_path / "hf"
    out.mkdir()
    gguf_to_checkpoint(path, out)
    return path, out


@pytest.mark.parametrize("qtype", [Q.F32, Q.Q8_0])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_weights_agree_with_transformers_own_gguf_reader(checkpoints, tmp_path, family, qtype):
    from transformers import AutoModelForCausalLM

    path, out = _import(checkpoints[family][0], tmp_path, qtype)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == ("llama" if family == "mistral" else family)
    ours = load_file(str(out / "model.safetensors"))
    overrides = {k: v for k, v in FAMILIES[family].items() if v is not None}
    theirs = AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=path.name, dtype=torch.float32, **overrides
    ).state_dict()
    assert ours
    for name, array in ours.items():
        assert np.allclose(theirs[name].numpy(), array, rtol=0, atol=1e-6), name
    if qtype == Q.F32:  # and they are the checkpoint's own
        original = checkpoints[family][1].state_dict()
        for name, array in ours.items():
            assert np.allclose(original[name].numpy(), array, rtol=0, atol=1e-6), name


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_match_the_hf_model_the_file_came_from(checkpoints, tmp_path, family):
    checkpoint, hf_model = checkpoints[family]
    _, out = _import(checkpoint, tmp_path)
    runner = ModelRunner(out, num_device_blocks=32, num_host_blocks=0, dtype="float32")
    prompt = torch.randint(3, 400, (30,), generator=torch.Generator().manual_seed(7)).tolist()
    with torch.no_grad():
        want = hf_model(torch.tensor([prompt])).logits[0]
    assert (runner.forward_logits(prompt) - want).abs().max().item() < 1e-4


def test_phi3_partial_rotary_comes_from_the_rope_dimension_count(tmp_path):
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    hf_model = _checkpoint("phi3", tmp_path / "ck", seed=9, rope_parameters=rope)
    _, out = _import(tmp_path / "ck", tmp_path)
    assert json.loads((out / "config.json").read_text())["partial_rotary_factor"] == 0.5
    runner = ModelRunner(out, num_device_blocks=32, num_host_blocks=0, dtype="float32")
    prompt = list(range(3, 40))
    with torch.no_grad():
        want = hf_model(torch.tensor([prompt])).logits[0]
    assert (runner.forward_logits(prompt) - want).abs().max().item() < 1e-4


def test_qwen2_yarn_rope_scaling_is_read(tmp_path):
    rope = {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 32,
        "rope_theta": 10000.0,
    }
    hf_model = _checkpoint("qwen2", tmp_path / "ck", seed=8, rope_parameters=rope)
    _, out = _import(tmp_path / "ck", tmp_path)
    scaling = json.loads((out / "config.json").read_text())["rope_scaling"]
    assert scaling == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
    runner = ModelRunner(out, num_device_blocks=32, num_host_blocks=0, dtype="float32")
    prompt = list(range(3, 70))
    with torch.no_grad():
        want = hf_model(torch.tensor([prompt])).logits[0]
    assert (runner.forward_logits(prompt) - want).abs().max().item() < 1e-4


@pytest.mark.parametrize(
    "rope",
    [
        # blends two frequencies: the two wavelengths are fitted to the file's factors
        {"factor": 8.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
        # blends one: LLaMA 3.2's own settings are tried (its original context is 8192)
        {"factor": 32.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    ],
)
def test_llama3_rope_freqs_are_read_as_hfs_llama3_scaling(tmp_path, rope):
    """llama.cpp writes LLaMA 3's scaling as per-frequency divisors (``rope_freqs``), not
    as settings: the import turns them back into HF's ``llama3`` rope_scaling, and the
    engine's logits are the HF model's, past the original context too."""
    rope = {"rope_type": "llama3", "low_freq_factor": 1.0, "rope_theta": 10000.0} | rope
    if rope["factor"] == 32.0:
        rope["rope_theta"] = 500000.0
    hf_model = _checkpoint("llama", tmp_path / "ck", seed=10, rope_parameters=rope)
    path, out = _import(tmp_path / "ck", tmp_path)
    assert "rope_freqs.weight" in {t.name for t in gguf.GGUFReader(str(path)).tensors}
    scaling = json.loads((out / "config.json").read_text())["rope_scaling"]
    assert scaling == {k: v for k, v in rope.items() if k != "rope_theta"}
    runner = ModelRunner(out, num_device_blocks=32, num_host_blocks=0, dtype="float32")
    prompt = torch.randint(3, 400, (100,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.no_grad():
        want = hf_model(torch.tensor([prompt])).logits[0]
    got = runner.forward_logits(prompt)
    assert (got - want).abs().max().item() < 1e-4
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_phi3_longrope_is_read_as_hf_holds_it_and_served(tmp_path):
    """Phi-3's longrope (two factor tensors, the original context and attention factor in
    the metadata) becomes the rope_scaling HF's config holds, and the engine built from the
    file gives the HF model's logits on both sides of the original context."""
    half = 8  # head_dim 16
    rope = {
        "rope_type": "longrope",
        "long_factor": [1.0 + 0.5 * i for i in range(half)],
        "short_factor": [1.0 + 0.05 * i for i in range(half)],
        "rope_theta": 10000.0,
    }
    hf_model = _checkpoint(
        "phi3", tmp_path / "ck", seed=11, rope_parameters=rope, original_max_position_embeddings=64
    )
    path, out = _import(tmp_path / "ck", tmp_path)
    config = json.loads((out / "config.json").read_text())
    scaling = config["rope_scaling"]
    assert scaling["rope_type"] == "longrope" and "attention_factor" not in scaling
    for name in ("long_factor", "short_factor"):  # as HF reads them: in float32
        assert np.array_equal(np.float32(scaling[name]), np.float32(rope[name]))
    assert scaling["original_max_position_embeddings"] == 64
    assert config["original_max_position_embeddings"] == 64
    assert config["max_position_embeddings"] == COMMON["max_position_embeddings"]
    runner = ModelRunner(out, num_device_blocks=32, num_host_blocks=0, dtype="float32")
    for length in (40, 100):  # short factors, then long ones
        prompt = torch.randint(3, 400, (length,), generator=torch.Generator().manual_seed(4))
        with torch.no_grad():
            want = hf_model(prompt[None]).logits[0]
        got = runner.forward_logits(prompt.tolist())
        assert (got - want).abs().max().item() < 1e-4, length
        assert torch.equal(got.argmax(-1), want.argmax(-1))
    options = BuildOptions(kv_cache_memory=1 << 20, host_cache_memory=0)
    build_engine_dir(path, tmp_path / "engine", options)  # served: no refusal at build time


def test_rope_factors_of_another_form_are_refused(tmp_path):
    path = tmp_path / "odd.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(128)
    writer.add_head_count(4)
    writer.add_tensor("token_embd.weight", np.zeros((16, 64), dtype=np.float32))
    writer.add_tensor("rope_freqs.weight", np.array([1, 3, 2, 5, 1, 7, 2, 9], dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    out = tmp_path / "hf"
    out.mkdir()
    with pytest.raises(BuildError, match=r"rope_freqs\.weight is not LLaMA 3's"):
        gguf_to_checkpoint(path, out)


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2"])
def test_tokenizer_splits_as_transformers_gguf_tokenizer(checkpoints, tmp_path, pre):
    """(transformers' GGUF tokenizer does not split digits one by one under ``smollm``;
    test_gguf_import checks that split against the checkpoint's own tokenizer.json.)"""
    from transformers import AutoTokenizer

    family = "qwen2" if pre == "qwen2" else "phi3"
    path, out = _import(checkpoints[family][0], tmp_path, pre=pre)
    ours = load_tokenizer(out)
    theirs = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in [*TEXTS, "digits 1234567 and 'll 's"]:
        want = theirs.encode(text, add_special_tokens=False)
        assert ours.encode(text, add_special_tokens=False) == want, text
        assert ours.decode(want) == theirs.decode(want)


@pytest.mark.engine
@pytest.mark.parametrize(
    ("family", "qtype"),
    [("qwen2", Q.Q8_0), ("qwen2", Q.Q4_1), ("qwen3", Q.Q4_0), ("phi3", Q.Q4_1), ("gemma2", Q.Q8_0)],
)
def test_kept_quantized_tensors_answer_as_their_dequantized_twin(
    checkpoints, tmp_path, family, qtype
):
    """``--quantization keep``: Qwen2's q/k/v biases beside kept weights, Phi-3's fused
    qkv and gate_up kept whole, Gemma 2's offset norms left in float."""
    path = tmp_path / "m.gguf"
    write_gguf(checkpoints[family][0], path, qtype=qtype)
    options = BuildOptions(
        dtype="float32", quantization="keep", kv_cache_memory=1 << 20, host_cache_memory=0
    )
    engine = tmp_path / "kept"
    manifest = build_engine_dir(path, engine, options)
    assert manifest.source.format == "gguf" and qtype.name in (manifest.source.quantization or "")
    assert manifest.quantization is not None  # the engine holds the file's codes
    reference = write_dequantized(engine, tmp_path / "reference")
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    answers = [
        [list(r.token_ids) for r in LLM(str(d), dtype="float32").generate(TEXTS, params)]
        for d in (engine, reference)
    ]
    assert answers[0] == answers[1]


def _sentencepiece_gguf(path: Path, add_space_prefix: bool) -> None:
    """A SentencePiece vocabulary as llama.cpp's converter stores one: ``<unk>``, ``<s>``,
    ``</s>``, the 256 byte pieces, then pieces with scores (best first) and no merges; the
    pieces are a ``tokenizers`` BPE's, trained on the build corpus with SentencePiece's
    visible space."""
    from quanta.build.corpus import CORPUS
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    trained = Tokenizer(models.BPE())
    trained.pre_tokenizer = pre_tokenizers.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=400, show_progress=False)
    trained.train_from_iterator([CORPUS], trainer=trainer)
    pieces = [t for t, _ in sorted(trained.get_vocab().items(), key=lambda kv: kv[1])]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    types = [2, 3, 3, *[6] * 256, *[1] * len(pieces)]
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    writer = gguf.GGUFWriter(str(path), "phi3")  # Phi-3's GGUFs hold such a vocabulary
    writer.add_block_count(1)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_space_prefix(add_space_prefix)
    writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_sentencepiece_vocabulary_splits_as_transformers_gguf_tokenizer(tmp_path):
    """transformers builds Phi-3's with llama.cpp's prefix (a space before the text, even
    one that starts with spaces); for other architectures it uses ``Metaspace``, which does
    not add one there."""
    from transformers import AutoTokenizer

    path = tmp_path / "spm.gguf"
    _sentencepiece_gguf(path, add_space_prefix=True)
    out = tmp_path / "hf"
    out.mkdir()
    gguf_to_checkpoint(path, out)
    ours = load_tokenizer(out)
    theirs = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    assert ours.bos_token_id == 1 and ours.eos_token_id == 2
    for text in [*TEXTS, "</s> after a special", "emoji \U0001f642 bytes"]:
        want = theirs.encode(text)
        assert want[0] == 1  # llama.cpp's default: BOS first
        assert ours.encode(text) == want, text
        assert ours.decode(want) == theirs.decode(want, skip_special_tokens=True), text


def test_sentencepiece_without_space_prefix_puts_no_space_in_front(tmp_path):
    """Gemma's files turn the prefix off (transformers' GGUF tokenizer adds it regardless;
    llama.cpp does not)."""
    path = tmp_path / "spm.gguf"
    _sentencepiece_gguf(path, add_space_prefix=False)
    out = tmp_path / "hf"
    out.mkdir()
    gguf_to_checkpoint(path, out)
    ours = load_tokenizer(out)
    pieces = ours.backend.encode("Hello, world!", add_special_tokens=False).tokens
    assert pieces[0] == "H" and "\u2581wor" in pieces
    for text in TEXTS:
        assert ours.decode(ours.encode(text)) == text
