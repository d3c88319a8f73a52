"""The device KV tier sized from the device's memory (``--gpu-memory-utilization``): the
arithmetic on made-up numbers, the runner's profiling and deferred allocation on the CPU
through a stand-in for the device's memory, and which setting wins. The same sizing on a
real GPU: ``tests/runner/test_cuda.py``."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from quanta.core.block_pool import Tier
from quanta.core.config import EngineConfig
from quanta.core.output import ScheduledSeq, SchedulerOutput
from quanta.frontends.engine import _memory_utilization
from quanta.frontends.triton.model_entry import served_parameters
from quanta.frontends.triton.settings import parse_parameters
from quanta.runner import ModelRunner, load_model_config
from quanta.runner.memory import (
    MemoryBudgetError,
    MemoryUse,
    describe_kv_sizing,
    kv_cache_blocks,
    kv_cache_bytes,
)

GiB = 1 << 30
MiB = 1 << 20


def _use(**overrides: int) -> MemoryUse:
    """An 80 GiB card, all of it free, holding 16 GiB once loaded (15 GiB of weights) and
    peaking 2 GiB above that in the largest step."""
    numbers = {
        "total": 80 * GiB,
        "free_at_start": 80 * GiB,
        "loaded": 16 * GiB,
        "weights": 15 * GiB,
        "peak_activation": 2 * GiB,
    }
    return MemoryUse(**(numbers | overrides))


def test_the_kv_cache_gets_the_budget_less_weights_activations_and_graphs() -> None:
    assert kv_cache_bytes(_use(), 0.9) == int(80 * GiB * 0.9) - 18 * GiB
    with_graphs = _use(graph_pool=1 * GiB)
    assert kv_cache_bytes(with_graphs, 0.9) == int(80 * GiB * 0.9) - 19 * GiB
    assert kv_cache_blocks(with_graphs, 0.9, 2 * MiB) == (int(80 * GiB * 0.9) - 19 * GiB) // (
        2 * MiB
    )


def test_a_lower_utilization_leaves_the_rest_of_the_card_untouched() -> None:
    half = kv_cache_bytes(_use(), 0.5)
    assert half == 40 * GiB - 18 * GiB
    assert half + _use().non_kv <= 80 * GiB * 0.5


def test_weights_beyond_the_budget_say_what_they_need_and_which_flag_to_raise() -> None:
    use = _use(loaded=30 * GiB, weights=29 * GiB)
    with pytest.raises(MemoryBudgetError) as err:
        kv_cache_bytes(use, 0.3)
    message = str(err.value)
    assert "the weights alone need 30.0GiB" in message
    assert "raise --gpu-memory-utilization above 0.40" in message  # (30 + 2) / 80


def test_activations_that_leave_nothing_name_both_ways_out() -> None:
    with pytest.raises(MemoryBudgetError, match="--max-num-batched-tokens") as err:
        kv_cache_bytes(_use(peak_activation=20 * GiB), 0.45)  # 36 GiB < 16 + 20
    assert "raise --gpu-memory-utilization above 0.45" in str(err.value)


def test_other_processes_leaving_less_than_the_budget_fail_the_start() -> None:
    with pytest.raises(MemoryBudgetError, match=r"at most 0\.62"):
        kv_cache_bytes(_use(free_at_start=50 * GiB), 0.9)


def test_a_budget_smaller_than_one_block_is_refused() -> None:
    # an 18 GiB budget with 1 MiB left over
    use = _use(total=20 * GiB, free_at_start=20 * GiB, peak_activation=2 * GiB - MiB)
    with pytest.raises(MemoryBudgetError, match=r"holds no block of 2\.0MiB"):
        kv_cache_blocks(use, 0.9, 2 * MiB)


def test_the_start_up_line_reports_what_was_found() -> None:
    line = describe_kv_sizing(_use(), 0.9, blocks=100, bytes_per_block=2 * MiB)
    for part in ("80.0GiB total", "weights 15.0GiB", "activation peak 2.0GiB", "100 device blocks"):
        assert part in line


# -- which setting sizes the device tier ------------------------------------------------------
@pytest.mark.parametrize(
    ("cache", "want"),
    [
        ({}, 0.9),
        ({"gpu_memory_utilization": 0.5}, 0.5),
        ({"gpu_memory_utilization": 0.5, "num_device_blocks": 64}, None),
        ({"gpu_memory_utilization": 0.5, "device_bytes": GiB}, None),
        ({"device_bytes": GiB}, None),
    ],
)
def test_on_cuda_an_explicit_size_wins_and_else_the_utilization_sizes_the_tier(
    cache: dict[str, float], want: float | None
) -> None:
    config = EngineConfig(model="m", device="cuda", cache=cache)
    assert _memory_utilization(config) == want


def test_the_cpu_ignores_the_utilization_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    config = EngineConfig(model="m", cache={"gpu_memory_utilization": 0.5})
    with caplog.at_level(logging.WARNING):
        assert _memory_utilization(config) is None
    assert "gpu_memory_utilization 0.5 ignored on cpu" in caplog.text


def test_config_pbtxt_and_serve_carry_the_utilization_beside_an_explicit_size() -> None:
    """``quanta serve MODEL --gpu-memory-utilization`` writes the parameter, and beside a
    size it is no conflict (the size wins at load)."""
    params = served_parameters(gpu_memory_utilization=0.5, kv_cache_memory="1GiB")
    assert params == {"gpu_memory_utilization": "0.5", "device_bytes": str(GiB)}
    config, _ = parse_parameters({"model_dir": "/m", "device": "cuda", **params})
    assert config.cache.gpu_memory_utilization == 0.5
    assert _memory_utilization(config) is None
    config, _ = parse_parameters({"model_dir": "/m", "device": "cuda"})
    assert _memory_utilization(config) == 0.9


# -- the runner, profiled on the CPU through a stand-in ----------------------------------------
class StandIn:
    """A device's memory as scripted numbers: ``free`` drops by ``loaded`` once the weights
    are in; the profiled peak is ``peak``. Records the calls in order."""

    def __init__(self, total: int, loaded: int, peak: int) -> None:
        self.numbers = (total, loaded, peak)
        self.calls: list[str] = []

    def total(self) -> int:
        self.calls.append("total")
        return self.numbers[0]

    def free(self) -> int:
        total, loaded, _ = self.numbers
        self.calls.append("free")
        return total if self.calls.count("free") == 1 else total - loaded

    def start_peak(self) -> None:
        self.calls.append("start_peak")

    def peak(self) -> int:
        self.calls.append("peak")
        return self.numbers[2]


BLOCK = 4
PROMPT = [(5 * j + 3) % 200 + 4 for j in range(21)]


def _seq(tokens: list[int], start: int) -> ScheduledSeq:
    return ScheduledSeq(
        request_id="r0",
        token_ids=tuple(tokens),
        start_pos=start,
        block_table=(0, 1, 2, 3, 4, 5),
        sample=True,
        temperature=0.0,
        top_p=1.0,
        top_k=0,
        seed=7,
        output_index=start - len(PROMPT) + 1 if start else 0,
    )


def _generate(runner: ModelRunner) -> list[int | None]:
    out = runner.execute(SchedulerOutput(seqs=(_seq(PROMPT, 0),)))
    tokens = list(out.sampled_token_ids)
    for _ in range(2):
        last = tokens[-1]
        assert last is not None
        step = SchedulerOutput(seqs=(_seq([last], len(PROMPT) + len(tokens) - 1),))
        tokens.extend(runner.execute(step).sampled_token_ids)
    return tokens


@pytest.mark.engine
def test_the_runner_sizes_its_cache_after_profiling_and_runs_as_one_sized_by_hand(
    opt_tiny: Path, caplog: pytest.LogCaptureFixture
) -> None:
    per_block = ModelRunner.kv_bytes_per_block(load_model_config(opt_tiny), BLOCK, torch.float32)
    loaded, peak = 100 * per_block, 20 * per_block
    memory = StandIn(total=1000 * per_block, loaded=loaded, peak=peak)
    with caplog.at_level(logging.INFO, logger="quanta.runner.model_runner"):
        sized = ModelRunner.sized_by_memory(
            opt_tiny,
            utilization=0.5,
            max_num_batched_tokens=48,
            max_num_seqs=4,
            memory=memory,
            num_host_blocks=4,
            block_size=BLOCK,
            dtype="float32",
        )
    assert sized.num_device_blocks == 500 - 100 - 20
    assert sized.device_kv_cache.shape[2] == 380
    assert memory.calls.index("start_peak") < memory.calls.index("peak")
    assert memory.calls[0] == "free"  # before the weights
    assert "380 device blocks" in caplog.text
    by_hand = ModelRunner(
        opt_tiny, num_device_blocks=380, num_host_blocks=4, block_size=BLOCK, dtype="float32"
    )
    assert _generate(sized) == _generate(by_hand)


@pytest.mark.engine
def test_a_runner_whose_weights_exceed_the_budget_stops_with_the_flag(opt_tiny: Path) -> None:
    per_block = ModelRunner.kv_bytes_per_block(load_model_config(opt_tiny), BLOCK, torch.float32)
    memory = StandIn(total=100 * per_block, loaded=60 * per_block, peak=per_block)
    with pytest.raises(MemoryBudgetError, match="--gpu-memory-utilization"):
        ModelRunner.sized_by_memory(
            opt_tiny,
            utilization=0.5,
            max_num_batched_tokens=16,
            max_num_seqs=2,
            memory=memory,
            num_host_blocks=0,
            block_size=BLOCK,
            dtype="float32",
        )


@pytest.mark.engine
def test_an_engine_sized_by_memory_gives_its_blocks_to_the_scheduler(
    opt_tiny: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine builder's path on a device sized by memory, run on the CPU: the stand-in
    plays the device and the block manager gets the blocks the runner allocated."""
    import quanta
    from quanta.frontends import engine
    from quanta.runner import model_runner

    per_block = ModelRunner.kv_bytes_per_block(load_model_config(opt_tiny), 16, torch.float32)
    monkeypatch.setattr(engine, "_memory_utilization", lambda config: 0.5)
    monkeypatch.setattr(
        model_runner, "CudaMemory", lambda device: StandIn(400 * per_block, 50 * per_block, 0)
    )
    llm = quanta.LLM(str(opt_tiny), dtype="float32", max_num_batched_tokens=64)
    assert llm.engine.runner.num_device_blocks == 150
    assert llm.engine.loop.blocks.num_total(Tier.DEVICE) == 150
    assert llm.engine.describe()["device_blocks"] == "150"
    result = llm.generate("Hello", quanta.SamplingParams(max_tokens=4, temperature=0.0))[0]
    assert result.error is None and len(result.token_ids) == 4


@pytest.mark.engine
def test_on_the_cpu_the_engine_keeps_its_default_tier(opt_tiny: Path) -> None:
    import quanta

    llm = quanta.LLM(str(opt_tiny), dtype="float32", gpu_memory_utilization=0.5)
    per_block = ModelRunner.kv_bytes_per_block(load_model_config(opt_tiny), 16, torch.float32)
    assert llm.engine.runner.num_device_blocks == GiB // per_block
