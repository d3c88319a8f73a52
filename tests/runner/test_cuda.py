"""The PyTorch engine on a CUDA device: the invariants the CPU suite checks, run where the
weights, both KV tiers' copies, the samplers and the kernels live on a GPU.

Skipped where torch sees no GPU (the CI machine has none). On a GPU machine:
``python -m pytest -p no:xdist -m gpu tests/runner/test_cuda.py``. fp32 is compared token for token
(HF transformers on the same device, and the engine against itself across preemption);
fp16 and bf16, whose roundings differ between any two implementations, by log-probabilities.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import quanta
import torch
from quanta import SamplingParams, StructuredOutput

transformers = pytest.importorskip("transformers")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.engine,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
]

PROMPTS = [
    "Hello, my name is",
    "The capital of France",
    "a",
    "Once upon a time, in a land far away, there lived a small dragon who",
]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0)
SEEDED = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9, seed=7)
# the bias and min-p run on the GPU's logits (the bias) and after them (min-p)
BIASED = SamplingParams(
    max_tokens=24, temperature=1.1, seed=5, min_p=0.05, logit_bias={5: 3.0, 9: -100.0}
)


@pytest.fixture(scope="module", params=["opt-tiny", "llama-tiny"])
def model_dir(request, tiny_checkpoint) -> Path:
    return tiny_checkpoint(request.param)


def _llm(model_dir: Path, **kw) -> quanta.LLM:
    return quanta.LLM(str(model_dir), device="cuda", **{"dtype": "float32", **kw})


def _tokens(llm: quanta.LLM, prompts: list[str], params) -> list[tuple[int, ...]]:
    out = [r.token_ids for r in llm.generate(prompts, params)]
    blocks = llm.engine.loop.blocks
    blocks.check_integrity()
    assert blocks.all_free()
    return out


def _hf_greedy(model_dir: Path, llm: quanta.LLM, dtype: torch.dtype) -> list[list[int]]:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    model = model.to("cuda").eval()
    out = []
    for p in PROMPTS:
        ids = torch.tensor([llm.tokenizer.encode(p)], device="cuda")
        with torch.no_grad():
            gen = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=GREEDY.max_tokens,
                pad_token_id=llm.tokenizer.eos_token_id,
            )
        out.append(gen[0, ids.shape[1] :].tolist())
    return out


@pytest.mark.parametrize("chunked", [False, True])
def test_greedy_tokens_equal_hf_on_the_gpu(model_dir, chunked):
    sched = {"enable_chunked_prefill": chunked, "max_num_batched_tokens": 8 if chunked else 512}
    llm = _llm(model_dir, scheduler=sched, cache={"num_device_blocks": 64})
    assert llm.engine.describe()["device"].startswith("cuda")
    assert [list(t) for t in _tokens(llm, PROMPTS, GREEDY)] == _hf_greedy(
        model_dir, llm, torch.float32
    )


@pytest.mark.parametrize("policy", ["fcfs", "sj-mlfq", "conserve"])
@pytest.mark.parametrize("host_blocks", [64, 0], ids=["swap", "recompute"])
def test_preemption_keeps_every_token_on_the_gpu(model_dir, policy, host_blocks):
    """Swaps copy blocks between the GPU and pinned host memory; recomputes rebuild them."""
    prompts = PROMPTS + PROMPTS[:3]
    params = [GREEDY] * len(PROMPTS) + [SEEDED] * 2 + [BIASED]
    roomy = _tokens(
        _llm(model_dir, policy=policy, cache={"num_device_blocks": 64}), prompts, params
    )
    cache = {"num_device_blocks": 20, "num_host_blocks": host_blocks, "block_size": 4}
    small = _llm(model_dir, policy=policy, cache=cache, scheduler={"max_num_batched_tokens": 16})
    assert _tokens(small, prompts, params) == roomy
    stats = small.engine.loop.stats()
    assert stats.num_preemptions_swap + stats.num_preemptions_recompute > 0


def test_prefix_caching_and_speculation_keep_the_tokens(model_dir):
    shared = "You are a careful assistant. Answer in one line. "
    prompts = [shared + p for p in PROMPTS] + ["one two three one two three one"]
    params = [GREEDY, SEEDED] * 2 + [GREEDY]
    plain = _tokens(_llm(model_dir, enable_prefix_caching=False), prompts, params)
    cached = _llm(model_dir, cache={"num_device_blocks": 64, "block_size": 4})
    assert _tokens(cached, prompts, params) == plain
    assert _tokens(cached, prompts, params) == plain  # the second time from the cache
    spec = _llm(
        model_dir,
        cache={"num_device_blocks": 12, "block_size": 8},
        speculative_config={"num_speculative_tokens": 4, "prompt_lookup_min": 1},
    )
    assert _tokens(spec, prompts, params) == plain
    assert spec.engine.loop.stats().spec_num_draft_tokens > 0


def test_structured_output_masks_the_gpus_logits(model_dir):
    """The mask worker's bias is built on the host and added to logits on the GPU."""
    pytest.importorskip("xgrammar")
    from test_structured_output import SCHEMA, assert_matches_schema

    llm = _llm(model_dir)
    spec = StructuredOutput(json_schema=SCHEMA)
    for params in (GREEDY, SEEDED):
        guided = params.model_copy(update={"max_tokens": 48, "structured_output": spec})
        for r in llm.generate(PROMPTS, guided):
            assert r.finish_reason == "stop", r.text
            assert_matches_schema(r.text)


def _logprobs(llm: quanta.LLM) -> torch.Tensor:
    from quanta_lab.bench.quality import quanta_token_logprobs

    ids = [(7 * i + 3) % 200 + 1 for i in range(40)]
    return torch.tensor(quanta_token_logprobs(llm, ids))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_stays_within_its_rounding(model_dir, dtype):
    """The engine in fp16 (CUDA's default) or bf16 is no further from its own fp32 answer
    than HF transformers in that dtype is from HF's fp32 on the same text."""
    want = _logprobs(_llm(model_dir))
    got = _logprobs(_llm(model_dir, dtype=dtype))
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    ids = torch.tensor([[(7 * i + 3) % 200 + 1 for i in range(40)]], device="cuda")

    def hf(dt: torch.dtype) -> torch.Tensor:
        with torch.no_grad():
            logits = model.to(device="cuda", dtype=dt)(ids).logits.float()[0, :-1]
        return logits.log_softmax(-1).gather(1, ids[0, 1:, None])[:, 0].cpu()

    rounding = float((hf(getattr(torch, dtype)) - hf(torch.float32)).abs().max())
    assert float((got - want).abs().max()) <= 2 * rounding + 1e-3


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_engines_run_their_gpu_kernels(tmp_path, quantization):
    """bf16 picks torch's CUDA int4 kernel (tinygemm) and, where torch has one, its int8
    kernel; the log-probabilities stay within bf16's rounding of the dequantized reference
    in fp32. The shape is wide enough for tinygemm's tiles (inputs a multiple of 128)."""
    from quanta.build.checkpoint import make_checkpoint
    from quanta.build.engine_build import BuildOptions, build_engine_dir
    from quanta.build.presets import get_preset
    from quanta.build.quantization import write_dequantized

    tiny = get_preset("llama-tiny")
    shape = tiny.shape.model_copy(
        update={"hidden_size": 256, "head_dim": 64, "intermediate_size": 512}
    )
    wide = tiny.model_copy(update={"name": "llama-wide", "shape": shape})
    source = make_checkpoint(wide, tmp_path / "source")
    engine = tmp_path / "engine"
    options = BuildOptions(
        kv_cache_memory=1 << 20,
        host_cache_memory=0,
        device="cuda",
        dtype="bfloat16",
        quantization=quantization,
        **({"group_size": 32} if quantization == "int4" else {}),
    )
    build_engine_dir(source, engine, options)
    reference = write_dequantized(engine, tmp_path / "reference")
    llm = quanta.LLM(str(engine), device="cuda", dtype="bfloat16")
    kernel = llm.engine.describe()["quantized_kernel"]
    print(f"{quantization} on {torch.cuda.get_device_name()}: kernel {kernel}")
    assert kernel == "int4pack" if quantization == "int4" else kernel in ("int8pack", "dequant")
    want = _logprobs(_llm(reference))
    rounding = float((_logprobs(_llm(reference, dtype="bfloat16")) - want).abs().max())
    assert float((_logprobs(llm) - want).abs().max()) <= 2 * rounding + 1e-3


def _cuda_step(heads: int, kv_heads: int, dtype: torch.dtype):
    """A mixed step on the GPU (a prompt, a chunk after cached context, short and long decode
    rows, blocks shuffled) and its layer cache, full of earlier tokens' K/V."""
    from types import SimpleNamespace

    block_size, head_dim, num_blocks = 16, 64, 512
    pool = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0)).tolist()
    seqs = []
    for start, n in [(0, 37), (700, 20), (9, 1), (1500, 1), (2100, 1)]:
        table = [pool.pop() for _ in range(-(-(start + n) // block_size))]
        seqs.append(SimpleNamespace(token_ids=(1,) * n, start_pos=start, block_table=tuple(table),
                                    hidden=False))  # fmt: skip
    tokens = sum(len(s.token_ids) for s in seqs)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(tokens, h, head_dim, generator=g, device="cuda", dtype=dtype)
               for h in (heads, kv_heads, kv_heads))  # fmt: skip
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=g,
                        device="cuda", dtype=dtype)  # fmt: skip
    return seqs, q, k, v, cache, block_size


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads"), [(8, 8), (12, 4), (32, 4)])
@pytest.mark.parametrize("decode_only", [False, True], ids=["mixed", "decode"])
def test_triton_attention_matches_the_torch_path(monkeypatch, dtype, heads, kv_heads, decode_only):
    """The compiled kernels against SDPA and the packed decode kernel; a decode-only step's
    contexts of 1,500 and 2,100 tokens run split and merged."""
    pytest.importorskip("triton")
    from quanta.runner.attention import build_metadata, paged_attention
    from quanta.runner.decode_kernel import decode_kernel

    seqs, q, k, v, cache, block_size = _cuda_step(heads, kv_heads, dtype)
    if decode_only:
        rows = sum(len(s.token_ids) for s in seqs[:2])
        seqs, q, k, v = seqs[2:], q[rows:], k[rows:], v[rows:]
    kernel, _ = decode_kernel("eager", heads=heads, kv_heads=kv_heads, head_dim=64, dtype=dtype)
    device = torch.device("cuda")
    monkeypatch.setenv("QUANTA_CUDA_ATTENTION", "torch")
    torch_meta = build_metadata(seqs, block_size, cache.shape[1], device, kernel)
    monkeypatch.setenv("QUANTA_CUDA_ATTENTION", "triton")
    triton_meta = build_metadata(seqs, block_size, cache.shape[1], device, kernel)
    assert torch_meta.paged is None and triton_meta.paged is not None
    assert (triton_meta.paged.num_splits > 1) == decode_only
    torch_cache = cache.clone()
    want = paged_attention(q, k, v, torch_cache, torch_meta, 0.125)
    got = paged_attention(q, k, v, cache, triton_meta, 0.125)
    assert torch.equal(cache, torch_cache)  # the K/V write kernel stores what index_copy does
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def test_triton_attention_keeps_the_greedy_tokens(model_dir, monkeypatch):
    """The engine's tokens with the Triton kernels equal the torch path's, chunked prefill
    (a chunk after cached context beside decode rows) included."""
    pytest.importorskip("triton")
    from quanta.runner import triton_attention

    calls = []
    launch = triton_attention.paged_attention
    monkeypatch.setattr(
        triton_attention, "paged_attention", lambda *a, **kw: calls.append(1) or launch(*a, **kw)
    )
    sched = {"enable_chunked_prefill": True, "max_num_batched_tokens": 8}
    params = [GREEDY, SEEDED] * 2
    monkeypatch.setenv("QUANTA_CUDA_ATTENTION", "torch")
    plain = _tokens(_llm(model_dir, scheduler=sched), PROMPTS, params)
    assert not calls
    monkeypatch.setenv("QUANTA_CUDA_ATTENTION", "triton")
    assert _tokens(_llm(model_dir, scheduler=sched), PROMPTS, params) == plain
    assert calls
