"""Parity of Quanta's PyTorch runner with HF transformers on tiny random checkpoints (fp32, CPU).

Covers: logits within 1e-4 for OPT (pre-LN, and post-LN with project_in/out) and LLaMA (GQA,
llama3 and linear RoPE scaling, tied head, biases, head_dim override, sharded save); greedy
generation through ``execute`` with mixed, chunked and staggered requests; swaps and shuffled
block tables; seeded sampling; config parsing and loader errors.
"""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from quanta.core.output import ScheduledSeq, SchedulerOutput
from quanta.runner import ModelRunner, load_model_config
from quanta.runner.models.config import RopeScaling, parse_model_config
from quanta.runner.sampler import sample
from runner_helpers import FakeRequest, ToyScheduler, build_hf_checkpoint, hf_greedy
from safetensors.torch import load_file, save_file

pytestmark = pytest.mark.engine


@functools.cache
def _compiles() -> bool:
    """Whether Inductor can build the compiled decode-attention kernel on this machine (a C++
    compiler and Python's headers); where it cannot, the engine runs eager, with a warning."""
    if not (shutil.which("c++") or shutil.which("g++")):
        return False
    from quanta.runner.decode_kernel import decode_kernel

    return decode_kernel("compiled", heads=4, kv_heads=2, head_dim=16, dtype=torch.float32)[1] == (
        "compiled"
    )


@functools.cache
def _native_builds() -> bool:
    """Whether the native decode-attention kernel builds here (a C compiler)."""
    from quanta.runner import native_decode

    return native_decode.load() is not None


# Decode-attention kernels as the tests run them. The torch kernels attend batches of up to
# ``ROW_BY_ROW_DECODE_ROWS`` rows row by row through SDPA; "-varlen" sends every decode batch
# through ``varlen_decode`` instead, so that path is checked on the tests' small batches too.
# NOTE: the conditions are strings, so pytest evaluates them (and builds the kernels) when a
# test that needs them runs, not when the module is collected.
KERNELS = [
    "eager",
    "eager-varlen",
    pytest.param(
        "compiled-varlen",
        marks=pytest.mark.skipif("not _compiles()", reason="torch.compile cannot build here"),
    ),
    pytest.param(
        "native",
        marks=pytest.mark.skipif("not _native_builds()", reason="no C compiler here"),
    ),
]


def _kernel(kernel: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """The runner's name for a ``KERNELS`` entry, with its row-by-row setting applied."""
    from quanta.runner import decode_kernel

    name, _, mode = kernel.partition("-")
    if mode == "varlen":
        monkeypatch.setattr(decode_kernel, "ROW_BY_ROW_DECODE_ROWS", 0)
    return name


CHECKPOINTS: dict[str, dict[str, Any]] = {
    "opt": {"family": "opt"},
    "opt350": {"family": "opt", "do_layer_norm_before": False, "word_embed_proj_dim": 32},
    "llama": {"family": "llama"},
    "llama3": {
        "family": "llama",
        "head_dim": 32,
        "tie_word_embeddings": True,
        "attention_bias": True,
        "mlp_bias": True,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    },
    "llama_linear": {
        "family": "llama",
        "num_hidden_layers": 3,
        "rope_theta": 500.0,
        "rope_scaling": {"rope_type": "linear", "factor": 2.0},
    },
    "llama_sharded": {"family": "llama", "max_shard_size": "50KB"},
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    built = {}
    for i, (name, spec) in enumerate(CHECKPOINTS.items()):
        path = tmp_path_factory.mktemp(name)
        settings = dict(spec)
        model = build_hf_checkpoint(settings.pop("family"), path, seed=i, **settings)
        built[name] = (path, model)
    return built


def _prompt(length: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, 300, (length,), generator=gen).tolist()


def _runner(path: Path, block_size: int = 16, blocks: int = 64, **kwargs: Any) -> ModelRunner:
    return ModelRunner(
        path, num_device_blocks=blocks, num_host_blocks=blocks, block_size=block_size, **kwargs
    )


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_logits_match_hf(checkpoints: dict[str, tuple[Path, Any]], name: str) -> None:
    path, hf_model = checkpoints[name]
    runner = _runner(path)
    for length in (1, 5, 16, 17, 45):
        prompt = _prompt(length, seed=length)
        with torch.no_grad():
            expected = hf_model(torch.tensor([prompt])).logits[0]
        for chunk_size in (None, 7):
            got = runner.forward_logits(prompt, chunk_size=chunk_size)
            diff = (got - expected).abs().max().item()
            assert diff < 1e-4, f"{name} len={length} chunk={chunk_size}: max diff {diff}"


def test_sharded_checkpoint_is_really_sharded(checkpoints: dict[str, tuple[Path, Any]]) -> None:
    path, _ = checkpoints["llama_sharded"]
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert not (path / "model.safetensors").exists()


def _mixed_requests(max_new: int = 10) -> list[FakeRequest]:
    """Mixed prompt lengths, chunked and unchunked prefills, staggered arrivals."""
    shapes = [(3, None, 0), (17, 5, 0), (9, 5, 2), (30, None, 3)]
    return [
        FakeRequest(f"r{i}", _prompt(n, 100 + i), max_new, chunk_size=chunk, arrival_step=arrive)
        for i, (n, chunk, arrive) in enumerate(shapes)
    ]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("name", ["opt", "opt350", "llama", "llama3"])
def test_greedy_generation_matches_hf(
    checkpoints: dict[str, tuple[Path, Any]],
    name: str,
    kernel: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every decode-attention kernel (native is the default where a C compiler exists and
    torch runs one thread; the suite runs eager unless a test asks)."""
    path, hf_model = checkpoints[name]
    kernel = _kernel(kernel, monkeypatch)
    runner = _runner(path, block_size=4, attention_kernel=kernel)
    assert runner.attention_kernel == kernel
    requests = _mixed_requests()
    toy = ToyScheduler(runner, requests, shuffle_seed=1)
    outputs = toy.run()
    assert toy.mixed_steps > 0, "no step mixed a prefill chunk with decodes"
    for request in requests:
        expected = hf_greedy(hf_model, request.prompt, request.max_new_tokens)
        assert outputs[request.request_id][: len(expected)] == expected, request.request_id


def _poison_freed_blocks(toy: ToyScheduler, output: SchedulerOutput) -> None:
    """After a swap-out, fill the freed device blocks with NaN, as if reused elsewhere."""
    freed = [device for device, _ in output.swap_out]
    if freed:
        toy.runner.device_kv_cache[:, :, freed] = float("nan")


@pytest.mark.parametrize("kernel", KERNELS)
def test_swap_and_shuffled_blocks_give_identical_tokens(
    checkpoints: dict[str, tuple[Path, Any]], kernel: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, hf_model = checkpoints["llama"]
    baseline = ToyScheduler(_runner(path, block_size=4), _mixed_requests()).run()

    runner = _runner(path, block_size=4, attention_kernel=_kernel(kernel, monkeypatch))
    runner.device_kv_cache.fill_(float("nan"))  # no read of a never-written slot may matter
    runner.host_kv_cache.fill_(float("nan"))
    swaps = {6: ("out", "r1"), 7: ("out", "r0"), 9: ("in", "r1"), 12: ("in", "r0")}
    toy = ToyScheduler(
        runner, _mixed_requests(), shuffle_seed=7, swaps=swaps, on_step=_poison_freed_blocks
    )
    swapped = toy.run()
    assert swapped == baseline
    r1 = next(r for r in toy.requests if r.request_id == "r1")
    assert r1.prompt and len(r1.block_table) > 1
    expected = hf_greedy(hf_model, r1.prompt, r1.max_new_tokens)
    assert swapped["r1"][: len(expected)] == expected


def _sampling_request(rid: str, **kwargs: Any) -> FakeRequest:
    settings = {"temperature": 0.9, "top_p": 0.9, "top_k": 50, "seed": 7, **kwargs}
    return FakeRequest(rid, _prompt(11, 5), 12, **settings)


def test_seeded_sampling_independent_of_batch_and_recompute(
    checkpoints: dict[str, tuple[Path, Any]],
) -> None:
    path, _ = checkpoints["opt"]
    alone = ToyScheduler(_runner(path, 4), [_sampling_request("a")]).run()["a"]

    others = [FakeRequest("g", _prompt(20, 9), 12, chunk_size=3), *_mixed_requests()[:2]]
    target = _sampling_request("a", chunk_size=4, arrival_step=1)

    preempted: list[int] = []

    def preempt_once(toy: ToyScheduler, _: SchedulerOutput) -> None:
        """After the 5th sampled token, drop the KV and recompute it from scratch."""
        if len(target.output) == 5 and not preempted:
            toy.device_blocks.release(target.block_table)
            target.block_table, target.num_computed = [], 0
            preempted.append(1)

    toy = ToyScheduler(_runner(path, 4), [*others, target], shuffle_seed=3, on_step=preempt_once)
    batched = toy.run()["a"]
    assert preempted, "the preemption never happened"
    assert batched == alone
    assert len(set(alone)) > 1


def test_seeded_sampling_differs_across_seeds(checkpoints: dict[str, tuple[Path, Any]]) -> None:
    path, _ = checkpoints["llama"]
    runs = [
        ToyScheduler(_runner(path, 4), [_sampling_request("a", seed=s, top_k=0)]).run()["a"]
        for s in (1, 2)
    ]
    assert runs[0] != runs[1]


def test_top_k_one_generation_equals_greedy(checkpoints: dict[str, tuple[Path, Any]]) -> None:
    path, _ = checkpoints["llama3"]
    greedy = ToyScheduler(_runner(path, 4), [_sampling_request("a", temperature=0.0)]).run()
    top1 = ToyScheduler(_runner(path, 4), [_sampling_request("a", top_k=1, top_p=1.0)]).run()
    assert greedy == top1


class _Row:
    def __init__(
        self,
        temperature: float,
        seed: int,
        index: int,
        top_k: int = 0,
        top_p: float = 1.0,
        min_p: float = 0.0,
    ) -> None:
        self.temperature, self.seed, self.output_index = temperature, seed, index
        self.top_k, self.top_p, self.min_p = top_k, top_p, min_p


def test_sampler_rows_do_not_depend_on_batch() -> None:
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(0)) * 2
    rows = [_Row(0.8, 1, 0), _Row(0.0, 2, 0), _Row(1.3, 3, 5, top_k=20), _Row(1.0, 4, 2)]
    rows += [_Row(0.7, 1, 1, top_p=0.8), _Row(1.0, 9, 0, top_k=5, top_p=0.5, min_p=0.2)]
    together = sample(logits, rows)
    alone = [sample(logits[i : i + 1], [row])[0] for i, row in enumerate(rows)]
    backwards = sample(logits.flip(0), rows[::-1])[::-1]
    assert together == alone == backwards
    assert together[1] == int(logits[1].argmax())


def test_sampler_seeds_matter_and_filters_reduce_to_greedy() -> None:
    flat = torch.zeros(1, 300)
    by_seed = {sample(flat, [_Row(1.0, seed, 0)])[0] for seed in range(64)}
    by_index = {sample(flat, [_Row(1.0, 0, index)])[0] for index in range(64)}
    assert len(by_seed) > 32 and len(by_index) > 32
    logits = torch.randn(40, 300, generator=torch.Generator().manual_seed(1)) * 3
    argmax = logits.argmax(dim=-1).tolist()
    assert sample(logits, [_Row(1.3, s, s, top_k=1) for s in range(40)]) == argmax
    assert sample(logits, [_Row(0.7, s, 0, top_p=1e-6) for s in range(40)]) == argmax


def test_config_parsing_layouts_and_errors(checkpoints: dict[str, tuple[Path, Any]]) -> None:
    base = {
        "model_type": "llama",
        "vocab_size": 10,
        "hidden_size": 8,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "intermediate_size": 16,
        "max_position_embeddings": 64,
        "eos_token_id": [2, 5],
    }
    old = parse_model_config(
        {**base, "rope_theta": 500.0, "rope_scaling": {"type": "linear", "factor": 4.0}},
        {"eos_token_id": 7},
    )
    new = parse_model_config(
        {**base, "rope_parameters": {"rope_type": "linear", "rope_theta": 500.0, "factor": 4.0}},
        {"eos_token_id": 7},
    )
    assert old == new
    assert old.rope_scaling == RopeScaling(rope_type="linear", factor=4.0)
    assert old.rope_theta == 500.0 and old.eos_token_ids == (2, 5, 7)
    assert old.num_kv_heads == 2 and old.head_dim == 4
    with pytest.raises(NotImplementedError, match="yarn"):
        parse_model_config({**base, "rope_scaling": {"rope_type": "yarn", "factor": 2.0}})
    with pytest.raises(ValueError, match="gpt2"):
        parse_model_config({**base, "model_type": "gpt2"})

    opt350 = load_model_config(checkpoints["opt350"][0])
    assert (opt350.family, opt350.do_layer_norm_before, opt350.word_embed_proj_dim) == (
        "opt",
        False,
        32,
    )
    llama3 = load_model_config(checkpoints["llama3"][0])
    assert llama3.rope_scaling is not None and llama3.rope_scaling.rope_type == "llama3"
    assert llama3.tie_word_embeddings and llama3.head_dim == 32


@pytest.mark.parametrize(("name", "strip"), [("opt", "model."), ("llama", "model.")])
def test_loader_accepts_keys_without_prefix(
    checkpoints: dict[str, tuple[Path, Any]], tmp_path: Path, name: str, strip: str
) -> None:
    path, hf_model = checkpoints[name]
    tensors = load_file(path / "model.safetensors")
    save_file(
        {k.removeprefix(strip): v for k, v in tensors.items()}, tmp_path / "model.safetensors"
    )
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    prompt = _prompt(20, 3)
    with torch.no_grad():
        expected = hf_model(torch.tensor([prompt])).logits[0]
    got = _runner(tmp_path).forward_logits(prompt)
    assert (got - expected).abs().max().item() < 1e-4


def test_loader_reports_missing_and_unexpected(
    checkpoints: dict[str, tuple[Path, Any]], tmp_path: Path
) -> None:
    path, _ = checkpoints["llama"]
    tensors = load_file(path / "model.safetensors")
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    dropped = "model.layers.1.mlp.up_proj.weight"
    save_file({k: v for k, v in tensors.items() if k != dropped}, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"1 missing .*up_proj"):
        _runner(tmp_path)
    save_file({**tensors, "model.extra.weight": torch.zeros(2)}, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"1 unexpected .*model\.extra\.weight"):
        _runner(tmp_path)


def test_kv_tiers_and_bytes_per_block(checkpoints: dict[str, tuple[Path, Any]]) -> None:
    path, _ = checkpoints["llama"]
    runner = ModelRunner(path, num_device_blocks=5, num_host_blocks=3, block_size=8)
    config = runner.model_config
    assert runner.device_kv_cache.shape == (config.num_layers, 2, 5, 8, 2, 16)
    assert runner.host_kv_cache.shape[2] == 3
    assert runner.bytes_per_block == runner.device_kv_cache.nbytes // 5
    assert ModelRunner.kv_bytes_per_block(config, 8, torch.float16) * 2 == runner.bytes_per_block
    empty = runner.execute(SchedulerOutput(seqs=()))
    assert empty.request_ids == () and empty.sampled_token_ids == ()


def test_malformed_step_raises_before_touching_the_cache(
    checkpoints: dict[str, tuple[Path, Any]],
) -> None:
    runner = _runner(checkpoints["opt"][0], block_size=4, blocks=4)
    runner.device_kv_cache.normal_()
    before = runner.device_kv_cache.clone()
    seq = ScheduledSeq("r", tuple(range(3, 12)), 0, (0, 1), True, 0.0, 1.0, 0, 0, 0)
    with pytest.raises(ValueError, match="needs 3 blocks"):
        runner.execute(SchedulerOutput(seqs=(seq,), swap_out=((1, 2),)))
    with pytest.raises(ValueError, match="out of range"):
        runner.execute(SchedulerOutput(seqs=(), swap_in=((0, 9),)))
    assert torch.equal(runner.device_kv_cache, before)
