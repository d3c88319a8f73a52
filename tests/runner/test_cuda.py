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
from runner_helpers import PROMPTS

transformers = pytest.importorskip("transformers")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.engine,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
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
    """An engine on the GPU; a KV tier of its own size unless the test sets one, so no
    engine sized by the GPU's memory outlives its test by accident and starves the next."""
    settings = {"dtype": "float32", "cache": {"num_device_blocks": 256}}
    return quanta.LLM(str(model_dir), device="cuda", **(settings | kw))


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
    from structured.test_structured_output import SCHEMA, assert_matches_schema

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


def _paths(llm: quanta.LLM) -> tuple[int, int]:
    paths = llm.engine.runner.step_paths
    return paths.graph, paths.eager


@pytest.mark.parametrize("chunked", [False, True])
def test_decode_graphs_keep_every_token(model_dir, monkeypatch, chunked):
    """Greedy, seeded and biased requests give the same tokens with decode graphs as with
    ``enforce_eager`` over the same Triton kernel; pure-decode steps replay a graph, prompt
    and mixed steps (chunked prefill beside decodes) run eagerly."""
    pytest.importorskip("triton")
    monkeypatch.setenv("QUANTA_CUDA_ATTENTION", "triton")
    sched = {"enable_chunked_prefill": chunked, "max_num_batched_tokens": 8 if chunked else 512}
    params = [GREEDY, SEEDED, BIASED, GREEDY]
    eager = _llm(model_dir, scheduler=sched, enforce_eager=True)
    want = _tokens(eager, PROMPTS, params)
    assert eager.engine.describe()["cuda_graphs"] == "off (enforce-eager)"
    assert _paths(eager)[0] == 0
    graphed = _llm(model_dir, scheduler={**sched, "max_num_seqs": 8})
    info = graphed.engine.describe()
    print(f"decode graphs {info['cuda_graph_sizes']} captured in {info['graph_capture_s']} s")
    assert info["cuda_graphs"] == "on" and info["cuda_graph_sizes"] == "1,2,4,8"
    assert _tokens(graphed, PROMPTS, params) == want
    graph_steps, eager_steps = _paths(graphed)
    assert graph_steps > 0 and eager_steps > 0
    assert graph_steps + eager_steps == sum(_paths(eager))


def test_decode_graphs_match_the_torch_path_and_stay_off_with_it(model_dir, monkeypatch):
    """The default engine (graphs on) gives the torch path's greedy tokens in fp32;
    ``QUANTA_CUDA_ATTENTION=torch`` turns graphs off, since that path reads lengths on the
    host."""
    pytest.importorskip("triton")
    monkeypatch.setenv("QUANTA_CUDA_ATTENTION", "torch")
    plain = _llm(model_dir)
    assert plain.engine.describe()["cuda_graphs"].startswith("off (QUANTA_CUDA_ATTENTION")
    want = _tokens(plain, PROMPTS, GREEDY)
    monkeypatch.delenv("QUANTA_CUDA_ATTENTION")
    graphed = _llm(model_dir)
    assert _tokens(graphed, PROMPTS, GREEDY) == want
    assert _paths(graphed)[0] > 0


@pytest.mark.parametrize("policy", ["sj-mlfq", "conserve"])
def test_decode_graphs_keep_the_tokens_under_preemption(model_dir, monkeypatch, policy):
    """Swaps and recomputes between replays, and ConServe's preemptible steps (run eagerly,
    with their safepoints), leave every request's tokens as a roomy eager run's."""
    pytest.importorskip("triton")
    monkeypatch.setenv("QUANTA_CUDA_ATTENTION", "triton")
    prompts = PROMPTS + PROMPTS[:3]
    params = [GREEDY] * len(PROMPTS) + [SEEDED] * 2 + [BIASED]
    roomy = _llm(model_dir, policy=policy, cache={"num_device_blocks": 64}, enforce_eager=True)
    want = _tokens(roomy, prompts, params)
    cache = {"num_device_blocks": 20, "num_host_blocks": 64, "block_size": 4}
    small = _llm(model_dir, policy=policy, cache=cache, scheduler={"max_num_batched_tokens": 16})
    assert _tokens(small, prompts, params) == want
    stats = small.engine.loop.stats()
    assert stats.num_preemptions_swap + stats.num_preemptions_recompute > 0
    assert _paths(small)[0] > 0


@pytest.mark.parametrize("family", ["mistral", "gemma2"])
def test_windowed_and_soft_capped_layers_keep_the_torch_paths_tokens_in_graphs(
    family, tmp_path, monkeypatch
):
    """A 4-token window the prompts outgrow (Mistral) and capped scores between windowed and
    global layers (Gemma 2) attend on the Triton kernel, decode steps replayed in graphs:
    greedy and seeded tokens are those of the torch path (``QUANTA_CUDA_ATTENTION=torch``)."""
    pytest.importorskip("triton")
    from quanta.runner import ModelRunner
    from runner_helpers import TINY_KIT_CONFIG, FakeRequest, ToyScheduler, widen_weights

    extra = {"query_pre_attn_scalar": 16, "attn_logit_softcapping": 2.0}
    config = transformers.AutoConfig.for_model(
        family, **TINY_KIT_CONFIG, head_dim=16, sliding_window=4,
        **(extra if family == "gemma2" else {}),
    )  # fmt: skip
    torch.manual_seed(3)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    widen_weights(model)
    model.save_pretrained(tmp_path, safe_serialization=True)

    def run() -> tuple[dict[str, list[int]], ModelRunner]:
        runner = ModelRunner(tmp_path, num_device_blocks=64, num_host_blocks=0, block_size=4,
                             dtype="float32", device="cuda", max_num_seqs=4)  # fmt: skip
        requests = [
            FakeRequest("a", [5, 17, 3, 250, 9, 33], max_new_tokens=12),
            FakeRequest("b", [71, 2, 8], max_new_tokens=9, temperature=0.8, top_p=0.9, seed=11),
            FakeRequest("c", list(range(100, 111)), max_new_tokens=6, arrival_step=2),
        ]
        return ToyScheduler(runner, requests).run(), runner

    monkeypatch.setenv("QUANTA_CUDA_ATTENTION", "torch")
    want, plain = run()
    assert plain.decode_graphs is None
    monkeypatch.delenv("QUANTA_CUDA_ATTENTION")
    got, graphed = run()
    assert graphed.decode_graphs is not None
    assert got == want
    assert graphed.step_paths.graph > 0


def test_the_kv_cache_takes_what_the_gpu_memory_utilization_leaves(model_dir):
    """Sized from the device's memory after the weights and a profiling forward: blocks
    enough for most of the budget (a tiny model's weights and activations take little of
    it), this process within the budget after generating, and the tokens of an engine
    whose tier has a size of its own. Eager, since the decode graphs' pool is captured
    after the sizing and not yet counted in it; a tenth of the card, so a tiny model's
    cache stays within 32-bit element offsets per layer."""
    from quanta.core.block_pool import Tier
    from quanta.runner.devices import CudaMemory

    memory = CudaMemory("cuda")
    total, free = memory.total(), memory.free()
    if free < total // 10:
        pytest.skip("other processes hold nine tenths of this GPU")
    llm = quanta.LLM(
        str(model_dir), device="cuda", dtype="float32", gpu_memory_utilization=0.1,
        enforce_eager=True,
    )  # fmt: skip
    runner = llm.engine.runner
    assert runner.num_device_blocks > 0
    assert llm.engine.describe()["device_blocks"] == str(runner.num_device_blocks)
    assert llm.engine.loop.blocks.num_total(Tier.DEVICE) == runner.num_device_blocks
    kv = runner.num_device_blocks * runner.bytes_per_block
    print(f"{torch.cuda.get_device_name()}: {runner.num_device_blocks} blocks, {kv} KV bytes")
    tokens = _tokens(llm, PROMPTS, GREEDY)
    assert free - torch.cuda.mem_get_info()[0] <= total // 10  # allocator's cache included
    assert kv >= 0.06 * total
    del llm, runner
    assert _tokens(_llm(model_dir, enforce_eager=True), PROMPTS, GREEDY) == tokens


def test_a_swap_round_trip_runs_on_the_side_stream_without_a_host_sync(model_dir):
    """Out to pinned host blocks (runs and single blocks) and back: the compute stream's
    later writes wait for the swap-out to have read the blocks, its reads wait for the
    swap-in, and neither copy makes the host wait (sync debug mode raises if one does)."""
    from quanta.runner import ModelRunner

    runner = ModelRunner(
        model_dir, num_device_blocks=16, num_host_blocks=16, block_size=4, device="cuda",
        dtype="float32", enforce_eager=True,
    )  # fmt: skip
    assert runner._copies.stream is not None and runner.host_kv_cache.is_pinned()
    device = runner.device_kv_cache
    device.normal_()
    out = ((3, 5), (7, 0), (8, 1), (9, 2))
    back = ((5, 10), (0, 11), (1, 12), (2, 13))
    swapped, restored = (torch.tensor([d for d, _ in out], device="cuda"),
                         torch.tensor([d for _, d in back], device="cuda"))  # fmt: skip
    want = device.index_select(2, swapped)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        runner._copy_blocks(out, device, runner.host_kv_cache)
        device.index_fill_(2, swapped, 0.0)  # queued after the swap-out: must not reach the host
        runner._copy_blocks(back, runner.host_kv_cache, device)
        got = device.index_select(2, restored)  # waits for the swap-in on the GPU
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.equal(got, want)


@pytest.mark.parametrize("policy", ["sj-mlfq", "fcfs"])
def test_swaps_on_the_side_stream_keep_every_token(model_dir, policy):
    """FastServe's proactive swaps (sj-mlfq) and reactive ones (fcfs) between the GPU and
    pinned memory, each batch of copies on the runner's own stream, give the tokens of an
    engine that never swaps."""
    import contextlib

    prompts = PROMPTS + PROMPTS[:3]
    params = [GREEDY] * len(PROMPTS) + [SEEDED] * 2 + [BIASED]
    roomy = _tokens(_llm(model_dir, policy=policy), prompts, params)
    cache = {"num_device_blocks": 20, "num_host_blocks": 64, "block_size": 4}
    small = _llm(model_dir, policy=policy, cache=cache, scheduler={"max_num_batched_tokens": 16})
    copies = small.engine.runner._copies
    streams = []
    run = copies.run

    @contextlib.contextmanager
    def seen():
        with run():
            streams.append(torch.cuda.current_stream())
            yield

    copies.run = seen
    assert _tokens(small, prompts, params) == roomy
    assert small.engine.loop.stats().num_preemptions_swap > 0
    assert streams and all(s == copies.stream for s in streams)
    assert copies.stream != torch.cuda.default_stream()


def _sampling_rows(bf16: bool):
    """Greedy and seeded rows of every kind; in bf16, whose logits tie often, no top-p (a
    GPU sort may order the tied tokens at the nucleus' edge differently)."""
    from types import SimpleNamespace as Row

    kinds = [
        dict(temperature=0.0),
        dict(temperature=1.0),
        dict(temperature=0.7, top_k=40),
        dict(temperature=1.3, min_p=0.05),
        dict(temperature=0.9, top_k=100, min_p=0.02),
    ]
    if not bf16:
        kinds += [dict(temperature=0.8, top_p=0.9), dict(temperature=1.1, top_k=50, top_p=0.7)]
    base = dict(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, processing=None)
    rows = []
    for i in range(32):
        kind = kinds[i % len(kinds)]
        rows.append(Row(**{**base, **kind}, seed=1000 + i, output_index=i))
    return rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [32_000, 151_936])
def test_device_sampling_picks_the_cpu_samplers_tokens(dtype, vocab):
    """Sampled on the GPU (noise drawn on the host, copied over pinned memory), every greedy
    and seeded row gets the token the per-row CPU sampler picks from the same logits."""
    from quanta.runner.device_sampler import DeviceSampler
    from quanta.runner.sampler import sample

    rows = _sampling_rows(dtype == torch.bfloat16)
    logits = (torch.randn(len(rows), vocab, generator=torch.Generator().manual_seed(0)) * 4).to(
        dtype
    )
    sampler = DeviceSampler()
    on_gpu = logits.cuda()
    handle = sampler.sample(on_gpu, rows, sampler.start(rows, vocab, on_gpu.device))
    assert handle.ids.device.type == "cuda"
    assert handle.tokens() == sample(logits, rows) == handle.ids.tolist()
    sampler.close()


def test_processing_and_logprobs_on_the_gpu_are_the_cpus():
    """Penalties, bias and bans applied on the GPU give the CPU's logits bit for bit; the
    log-probabilities come back through pinned memory within the softmax's rounding."""
    from types import SimpleNamespace as Row

    from quanta.core.output import LogitsProcessing
    from quanta.runner.device_sampler import DeviceSampler
    from quanta.runner.logits import process_logits

    vocab = 50_000
    history = tuple(range(0, 3000, 7))
    rows = [
        Row(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, seed=0, output_index=0,
            processing=LogitsProcessing(history=history, num_prompt_tokens=100,
                                        repetition_penalty=1.3, presence_penalty=0.4,
                                        frequency_penalty=0.5, logprobs=5)),
        Row(temperature=0.8, top_p=0.95, top_k=0, min_p=0.0, seed=3, output_index=4,
            processing=LogitsProcessing(logit_bias=((5, 3.0), (9, -100.0)), suppress=(2,),
                                        logprobs=0)),
        Row(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, seed=0, output_index=0,
            processing=None),
    ]  # fmt: skip
    logits = torch.randn(len(rows), vocab, generator=torch.Generator().manual_seed(1)) * 3
    on_gpu = logits.cuda()
    raw_cpu, raw_gpu = process_logits(logits, rows), process_logits(on_gpu, rows)
    assert torch.equal(on_gpu.cpu(), logits)
    sampler = DeviceSampler()
    cpu = sampler.sample(logits, rows, sampler.start(rows, vocab, logits.device), raw_cpu)
    gpu = sampler.sample(on_gpu, rows, sampler.start(rows, vocab, on_gpu.device), raw_gpu)
    assert gpu.tokens() == cpu.tokens()
    want, got = cpu.logprobs(), gpu.logprobs()
    assert sorted(got) == sorted(want) == [0, 1]
    for j in want:
        assert got[j].logprob == pytest.approx(want[j].logprob, abs=1e-5)
        assert [t for t, _ in got[j].top] == [t for t, _ in want[j].top]
    sampler.close()


def test_the_engine_samples_on_the_gpu_what_the_cpu_sampler_picks(model_dir, monkeypatch):
    """The whole engine: sampling on the GPU gives the tokens and logprobs of the per-row
    CPU sampler over the same logits (the path before sampling moved to the device)."""
    from quanta.runner.device_sampler import DeviceSampler, SampledTokens
    from quanta.runner.sampler import sample

    def per_row(self, logits, rows, noise, raw=None):
        ids = torch.tensor(sample(logits, rows), device=logits.device)
        return SampledTokens(ids, None if raw is None else raw.pick(ids))

    params = [GREEDY, SEEDED, BIASED, SamplingParams(max_tokens=24, temperature=0.8, seed=9,
              top_k=30, repetition_penalty=1.2, logprobs=3)]  # fmt: skip
    llm = _llm(model_dir)
    got = llm.generate(PROMPTS, params)
    monkeypatch.setattr(DeviceSampler, "sample", per_row)
    expected = llm.generate(PROMPTS, params)
    for g, e in zip(got, expected, strict=True):
        assert g.token_ids == e.token_ids
        assert [lp.logprob for lp in g.logprobs] == pytest.approx(
            [lp.logprob for lp in e.logprobs], abs=1e-5
        )


def test_random_weights_of_a_real_shape_are_made_on_the_gpu(tmp_path):
    """``load_format="dummy"`` (``quanta bench engine --preset``, bench/gpu/run.sh):
    LLaMA-3.2-1B's weights made on the device with no checkpoint, and the engine decodes."""
    from quanta.build.checkpoint import write_model_files
    from quanta.core.config import CacheConfig, EngineConfig
    from quanta.frontends.engine import build_engine

    engine = build_engine(
        EngineConfig(
            model=str(write_model_files("llama-3.2-1b", tmp_path)),
            load_format="dummy",
            dtype="bfloat16",
            device="cuda",
            cache=CacheConfig(num_device_blocks=64, num_host_blocks=0),
        )
    )
    try:
        weights = list(engine.runner.model.parameters())
        assert all(p.device.type == "cuda" and torch.isfinite(p).all() for p in weights)
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=1)
        stream = engine.loop.submit(engine.make_request(list(range(5, 69)), params))
        engine.loop.run_until_idle()
        result = stream.result(timeout=0)
        assert result.error is None and len(result.token_ids) == 8
        assert all(lp.logprob > float("-inf") for lp in result.logprobs)
    finally:
        engine.runner.close()


@pytest.mark.parametrize("policy", ["fcfs", "sj-mlfq"])
@pytest.mark.parametrize("host_blocks", [64, 0], ids=["swap", "recompute"])
def test_async_scheduling_keeps_every_token_and_is_on_by_default(model_dir, policy, host_blocks):
    """Each step scheduled while the one before runs on the GPU (its sampled ids fill the
    next step's placeholders on the step thread) gives the tokens of the engine that waits."""
    prompts = PROMPTS + PROMPTS[:3]
    params = [GREEDY] * len(PROMPTS) + [SEEDED] * 2 + [BIASED]
    cache = {"num_device_blocks": 20, "num_host_blocks": host_blocks, "block_size": 4}
    sched = {"max_num_batched_tokens": 16}
    off = _llm(model_dir, policy=policy, cache=cache, scheduler=sched, async_scheduling=False)
    on = _llm(model_dir, policy=policy, cache=cache, scheduler=sched)
    assert on.engine.describe()["async_scheduling"] == "true"
    assert _tokens(on, prompts, params) == _tokens(off, prompts, params)
    stats = on.engine.loop.stats()
    assert stats.num_overlapped_steps > 0
    assert stats.num_preemptions_swap + stats.num_preemptions_recompute > 0
