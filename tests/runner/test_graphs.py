"""Decode graphs (``quanta.runner.graphs``) on the CPU: the fixed buffers, the padding and the
dispatch run as on CUDA, with ``graphs.rerun`` standing in for the capture (the step function
run again over the same buffers) and the Triton kernel under its interpreter
(``TRITON_INTERPRET=1``) in fp32. The captured graphs themselves are checked on a GPU in
``tests/runner/test_cuda.py``.
"""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from quanta.core.output import PromptLogprobsAsk, ScheduledSeq, SchedulerOutput
from quanta.core.safepoint import AbortSignal
from quanta.runner import ModelRunner, graphs
from runner_helpers import (
    TINY_KIT_CONFIG,
    FakeRequest,
    ToyScheduler,
    interpreted_triton_attention,
    widen_weights,
)

ta = interpreted_triton_attention()
# A padded row merges splits it never wrote (its output is never read): numpy, running the
# kernels here, warns of the garbage it divides.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")

BLOCK_SIZE = 4
NUM_BLOCKS = 48


def _runner(model_dir: Path, *, graphed: bool, max_num_seqs: int = 4) -> ModelRunner:
    runner = ModelRunner(
        model_dir,
        num_device_blocks=NUM_BLOCKS,
        num_host_blocks=8,
        block_size=BLOCK_SIZE,
        dtype="float32",
        max_num_seqs=max_num_seqs,
    )
    if graphed:
        runner.capture_decode_graphs(graphs.rerun)
    return runner


def _requests() -> list[FakeRequest]:
    """Three requests that end at different steps (decode batches of 3, 2, then 1 rows, padded
    to 4, 2 and 1), one arriving late (a step mixing its prompt with decodes), one seeded."""
    return [
        FakeRequest("a", [5, 17, 3, 250, 9, 33], max_new_tokens=6),
        FakeRequest("b", [71, 2, 8], max_new_tokens=4, temperature=0.8, top_p=0.9, seed=11),
        FakeRequest("c", [100, 101, 102, 103, 104, 105, 106], max_new_tokens=2, arrival_step=2),
    ]


def test_graph_sizes_pad_to_powers_of_two_then_steps_of_eight_and_sixteen():
    assert graphs.graph_sizes(128) == (1, 2, 4, *range(8, 65, 8), 80, 96, 112, 128)
    assert graphs.graph_sizes(3) == (1, 2, 3)
    assert graphs.graph_sizes(100)[-3:] == (80, 96, 100)
    assert graphs.graph_sizes(10_000)[-1] == graphs.MAX_GRAPH_ROWS


def test_replayed_decodes_give_the_eager_tokens_and_padded_rows_write_nothing(llama_tiny):
    """Greedy and seeded requests through decode batches of every padded size give the tokens
    of the plain CPU runner; the replays reuse the same buffers whatever the batch, and the
    cache holds exactly the computed tokens' K/V: every other slot (the padded rows' included)
    keeps the NaN it started with."""
    graphed = _runner(llama_tiny, graphed=True)
    decode_graphs = graphed.decode_graphs
    assert decode_graphs is not None and decode_graphs.sizes == (1, 2, 4)
    buffers = decode_graphs._ints.data_ptr(), decode_graphs._logits.data_ptr()
    replayed: list[int] = []
    replay = decode_graphs.replay
    decode_graphs.replay = lambda n: replayed.append(decode_graphs.padded_size(n)) or replay(n)
    graphed.device_kv_cache.fill_(float("nan"))
    requests = _requests()
    tokens = ToyScheduler(graphed, requests, shuffle_seed=3).run()

    want = ToyScheduler(_runner(llama_tiny, graphed=False), _requests(), shuffle_seed=3).run()
    assert tokens == want
    assert set(replayed) == {4, 2, 1}
    assert (decode_graphs._ints.data_ptr(), decode_graphs._logits.data_ptr()) == buffers
    written = ~graphed.device_kv_cache[:, 0].isnan().all(dim=-1).all(dim=-1)  # [layers, slots]
    computed = sum(r.num_computed for r in requests)
    assert written.flatten(1).sum(dim=1).tolist() == [computed] * graphed.model_config.num_layers


def test_steps_a_graph_cannot_hold_run_eagerly_and_are_counted(llama_tiny):
    runner = _runner(llama_tiny, graphed=True, max_num_seqs=2)
    decode_graphs = runner.decode_graphs
    assert decode_graphs is not None
    scheduler = ToyScheduler(runner, [replace(r, arrival_step=0) for r in _requests()[::2]])
    scheduler.step(0)  # two prompts
    scheduler.step(1)  # two decodes
    assert (runner.step_paths.graph, runner.step_paths.eager) == (1, 1)
    seq = ScheduledSeq("x", (7,), 5, (0, 1), True, 0.0, 1.0, 0, 0, 0)
    reasons = {
        "prefill": [replace(seq, token_ids=(7, 8))],
        "hidden cache": [replace(seq, hidden=True)],
        "draft verification": [replace(seq, token_ids=(7, 8), num_draft_tokens=1)],
        "prompt logprobs": [replace(seq, prompt_logprobs=PromptLogprobsAsk(0, (7,), 0))],
        "more rows than the largest graph": [seq] * 3,
    }
    for reason, seqs in reasons.items():
        assert decode_graphs.eager_reason(SchedulerOutput(seqs=tuple(seqs))) == reason
    preemptible = SchedulerOutput(seqs=(seq,), abort=AbortSignal())
    assert decode_graphs.eager_reason(preemptible) == "preemptible"
    assert decode_graphs.eager_reason(SchedulerOutput(seqs=(seq, seq))) is None
    info = runner.decode_graph_info()
    assert info["cuda_graphs"] == "on" and info["cuda_graph_sizes"] == "1,2"
    assert (info["graph_steps"], info["eager_steps"]) == ("1", "1")


def test_a_preemptible_decode_runs_eagerly_and_stops_at_its_safepoint(llama_tiny):
    from quanta.core.safepoint import StepAborted

    runner = _runner(llama_tiny, graphed=True)
    request = FakeRequest("a", [5, 17, 3, 250, 9], max_new_tokens=3)
    ToyScheduler(runner, [request]).step(0)
    pos = len(request.prompt)
    seq = ScheduledSeq("a", (request.output[-1],), pos, tuple(request.block_table), True,
                       0.0, 1.0, 0, 0, 1)  # fmt: skip
    signal = AbortSignal()
    signal.raise_at(0.0)
    with pytest.raises(StepAborted):
        runner.execute(SchedulerOutput(seqs=(seq,), abort=signal))
    assert (runner.step_paths.graph, runner.step_paths.eager) == (0, 2)
    assert runner.execute(SchedulerOutput(seqs=(seq,))).sampled_token_ids[0] is not None
    assert runner.step_paths.graph == 1


def test_a_malformed_decode_step_is_refused_before_anything_is_written(llama_tiny):
    from quanta.core.output import MalformedStepError

    runner = _runner(llama_tiny, graphed=True)
    seq = ScheduledSeq("x", (7,), 5, (0,), True, 0.0, 1.0, 0, 0, 0)  # position 5: 2 blocks
    for bad in (seq, replace(seq, block_table=(0, NUM_BLOCKS))):
        with pytest.raises(MalformedStepError):
            runner.execute(SchedulerOutput(seqs=(bad,)))
    assert runner.step_paths.graph == 0


def test_models_a_graph_cannot_hold_stay_eager(llama_tiny):
    from quanta.runner import load_model_config

    base = load_model_config(llama_tiny)
    assert graphs.model_unsupported(base) is None
    assert graphs.unsupported(base, torch.device("cpu")) == "not a CUDA device"
    assert graphs.model_unsupported(base, tensor_parallel=True) == "tensor parallelism"
    windowed = replace(base, sliding_windows=(8, 0), attn_logit_softcapping=50.0)
    assert graphs.model_unsupported(windowed) is None  # the Triton kernel takes both


@pytest.mark.parametrize("family", ["mistral", "gemma2"])
def test_windowed_and_soft_capped_layers_attend_on_the_kernel_the_graphs_replay(
    family: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """Mistral with a 4-token window the prompts outgrow, Gemma 2 with soft-capped scores and
    windowed layers between global ones: with graphs, prompts, mixed steps and replayed
    decodes all attend through the Triton kernel (the torch path's windowed attention never
    runs, nor its row-by-row decode), and the tokens are the torch path's."""
    from quanta.runner.layers import attention
    from transformers import AutoConfig, AutoModelForCausalLM

    # a cap low enough to change the scores of these widened weights
    extra = (
        {"query_pre_attn_scalar": 16, "attn_logit_softcapping": 2.0} if family == "gemma2" else {}
    )
    config = AutoConfig.for_model(family, **TINY_KIT_CONFIG, head_dim=16, sliding_window=4, **extra)
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    widen_weights(model)
    model.save_pretrained(tmp_path, safe_serialization=True)
    want = ToyScheduler(_runner(tmp_path, graphed=False), _requests(), shuffle_seed=5).run()

    graphed = _runner(tmp_path, graphed=True)
    torch_path = attention.windowed_attention
    calls: list[int] = []
    monkeypatch.setattr(
        attention, "windowed_attention", lambda *a: calls.append(1) or torch_path(*a)
    )
    assert ToyScheduler(graphed, _requests(), shuffle_seed=5).run() == want
    assert graphed.step_paths.graph > 0 and graphed.step_paths.eager > 0
    assert not calls


def _release_loop(model_dir: Path, *, graphed: bool) -> tuple[dict[str, list[int]], ModelRunner]:
    """Greedy tokens of three long requests on the engine loop, whose block manager releases
    the blocks behind the window; freed device blocks are NaN after every step, so a read of a
    released block shows."""
    from quanta.core.block_pool import Tier
    from quanta.core.blocks import BlockManager
    from quanta.core.clock import VirtualClock
    from quanta.core.config import SchedulerConfig
    from quanta.core.loop import EngineLoop
    from quanta.core.request import Request, SamplingParams
    from quanta.core.window import kv_window
    from quanta.policies import make_policy

    runner = _runner(model_dir, graphed=graphed)
    window = kv_window(runner.model_config.sliding_windows)
    loop = EngineLoop(
        runner=runner,
        policy=make_policy("fcfs", SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=4)),
        blocks=BlockManager(BLOCK_SIZE, NUM_BLOCKS, 8, sliding_window=window),
        clock=VirtualClock(),
        max_model_len=128,
        decode=lambda ids: "",
    )
    prompts = [[(7 * i + 3 * j) % 500 + 3 for j in range(n)] for i, n in enumerate((13, 5, 17))]
    params = SamplingParams(max_tokens=12, temperature=0.0)
    requests = [Request(f"r{i}", p, params, i * 1e-3, i) for i, p in enumerate(prompts)]
    for r in requests:
        loop.submit(r)
    pool = loop.blocks.pools[Tier.DEVICE]
    while loop.has_unfinished():
        loop.step()
        stale = [b for b in pool.free_ids() if b not in pool.name_of]
        if stale:
            runner.device_kv_cache[:, :, stale] = float("nan")
    return {r.request_id: list(r.output_token_ids) for r in requests}, runner


def test_replayed_decodes_skip_the_blocks_a_window_released(tmp_path: Path):
    """Mistral with an 8-token window on the engine loop, which releases the blocks behind
    it: replayed decode steps read from each row's first held block (a released entry is
    never read, though its slot holds NaN) and give the eager tokens."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("mistral", **TINY_KIT_CONFIG, head_dim=16, sliding_window=8)
    torch.manual_seed(4)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    widen_weights(model)
    model.save_pretrained(tmp_path, safe_serialization=True)
    want, _ = _release_loop(tmp_path, graphed=False)
    got, graphed = _release_loop(tmp_path, graphed=True)
    assert got == want
    assert graphed.step_paths.graph > 0


KERNEL_BLOCK_SIZE = 16
KERNEL_BLOCKS = 160


def _decode_seqs(lengths: list[int], rng: random.Random) -> list[ScheduledSeq]:
    pool = list(range(KERNEL_BLOCKS))
    rng.shuffle(pool)
    seqs = []
    for length in lengths:
        table = tuple(pool.pop() for _ in range(-(-length // KERNEL_BLOCK_SIZE)))
        seqs.append(ScheduledSeq("r", (1,), length - 1, table, True, 0.0, 1.0, 0, 0, 0))
    return seqs


def test_a_decode_row_attends_alike_alone_in_a_batch_and_in_a_fixed_padded_launch():
    """Each row's split size is its own (``row_splits``), so its output is bitwise the same
    whatever the other rows' lengths and however many splits the launch has."""
    rng = random.Random(0)
    seqs = _decode_seqs([1300, 40, 700], rng)
    heads, kv_heads, head_dim = 4, 2, 8
    g = torch.Generator().manual_seed(0)
    cache = torch.randn(2, KERNEL_BLOCKS, KERNEL_BLOCK_SIZE, kv_heads, head_dim, generator=g)
    q = torch.randn(len(seqs), heads, head_dim, generator=g)
    device = torch.device("cpu")
    together = ta.paged_batch(seqs, KERNEL_BLOCK_SIZE, device)
    assert together.row_splits and together.num_splits == 3
    out = ta.attend(q, cache[0], cache[1], together, 0.5)
    for i, seq in enumerate(seqs):
        alone_batch = ta.paged_batch([seq], KERNEL_BLOCK_SIZE, device)
        alone = ta.attend(q[i : i + 1], cache[0], cache[1], alone_batch, 0.5)
        assert torch.equal(alone[0], out[i])
    # the graph's launch: 16 splits over padded buffers, a fourth row that reads nothing
    width = max(len(s.block_table) for s in seqs)
    tables = torch.zeros(4, width, dtype=torch.int32)
    for i, seq in enumerate(seqs):
        tables[i, : len(seq.block_table)] = torch.tensor(seq.block_table)
    ints = torch.tensor([[s.start_pos for s in seqs] + [0], [1, 1, 1, 0]], dtype=torch.int32)
    rows = torch.arange(4, dtype=torch.int32)
    zeros = torch.zeros(4, dtype=torch.int32)
    fixed = ta.fixed_decode_batch(tables, rows, ints[0], ints[1], zeros, zeros)
    padded = ta.attend(torch.cat((q, q[:1])), cache[0], cache[1], fixed, 0.5)
    assert torch.equal(padded[:3], out)


def test_enforce_eager_reaches_the_runner_and_the_engine_info(llama_tiny):
    import quanta

    for options, says in (
        ({}, "off (not a CUDA device)"),
        ({"enforce_eager": True}, "off (enforce-eager)"),
    ):
        info = quanta.LLM(str(llama_tiny), **options).engine.describe()
        assert info["cuda_graphs"] == says
        assert (info["cuda_graph_sizes"], info["graph_steps"]) == ("none", "0")
