"""``quanta bench loop``: what the loop itself costs per step, with a runner that does no math.

Everything but the forward pass runs as in a server: the policy, the block ledger, the
applier, the committer with the model's detokenizer and stop checks, and the sinks. The
runner answers instantly, so each step's wall time is the loop's own Python: the floor under
every engine step, which matters most at large batches of small models.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from quanta.core.blocks import BlockManager
from quanta.core.clock import WallClock
from quanta.core.config import SchedulerConfig
from quanta.core.loop import EngineLoop
from quanta.core.output import RunnerCapabilities, RunnerOutput, SchedulerOutput
from quanta.core.request import Request, SamplingParams
from quanta.policies import make_policy
from quanta.text.tokenizer import load_tokenizer


class NullRunner:
    """Samples a fixed token for every row that samples; no tensors at all."""

    capabilities = RunnerCapabilities()

    def __init__(self, token_id: int) -> None:
        self.token_id = token_id

    def execute(self, so: SchedulerOutput) -> RunnerOutput:
        return RunnerOutput(
            tuple(s.request_id for s in so.seqs),
            tuple(self.token_id if s.sample else None for s in so.seqs),
        )


def _text_token(decode: Callable[[list[int]], str], vocab_size: int) -> int:
    """An id that decodes to whole characters, as a model's output mostly does (an id that is
    half a UTF-8 character would make every step's text a run of replacement characters)."""
    for token_id in range(min(100, vocab_size - 1), vocab_size):
        text = decode([token_id])
        if text.strip() and "\ufffd" not in text:
            return token_id
    return min(100, vocab_size - 1)


@dataclass(frozen=True, slots=True)
class LoopOverhead:
    batch: int
    policy: str
    decode_steps: int
    step_us_median: float
    step_us_p90: float
    per_request_us: float


def measure_loop_overhead(
    model_dir: Path,
    batch: int = 32,
    prompt_len: int = 128,
    gen_len: int = 256,
    policy: str = "fcfs",
) -> LoopOverhead:
    """Median and p90 wall time of the all-decode steps of ``batch`` requests."""
    tokenizer = load_tokenizer(model_dir)
    block_size = 16
    blocks = batch * -(-(prompt_len + gen_len) // block_size) + batch
    loop = EngineLoop(
        runner=NullRunner(token_id=_text_token(tokenizer.decode, tokenizer.vocab_size)),
        policy=make_policy(policy, SchedulerConfig(max_num_seqs=batch)),
        blocks=BlockManager(block_size, blocks, 0),
        clock=WallClock(),
        max_model_len=prompt_len + gen_len,
        decode=tokenizer.decode,
    )
    params = SamplingParams(max_tokens=gen_len, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        request = Request(
            request_id=f"r{i}",
            prompt_token_ids=[(7 * i + j) % 200 + 3 for j in range(prompt_len)],
            params=params,
            arrival_time=loop.clock.now(),
            seed=i,
        )
        loop.submit(request)
    times: list[float] = []
    while True:
        started = time.perf_counter()
        worked = loop.step()
        elapsed = time.perf_counter() - started
        if not worked:
            break
        if loop.stats().num_running == batch:  # NOTE: all decoding; prefills excluded
            times.append(elapsed)
    times = times[1:-1] or times  # the first and last decode steps also admit/finish
    median = statistics.median(times)
    p90 = sorted(times)[int(0.9 * (len(times) - 1))]
    return LoopOverhead(batch, policy, len(times), median * 1e6, p90 * 1e6, median * 1e6 / batch)
