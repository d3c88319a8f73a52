"""The batched sampler against the per-row one: the same token for every kind of row, the
same processed logits and the same log-probabilities, on the CPU bit for bit.

The GPU's side of the same checks is in ``tests/runner/test_cuda.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import quanta
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from quanta import SamplingParams
from quanta.core.output import LogitsProcessing
from quanta.runner.device_sampler import (
    DeviceSampler,
    SampledTokens,
    _outside_nucleus,
    sample_tokens,
)
from quanta.runner.logits import process_logits, token_logprobs
from quanta.runner.sampler import exponential_noise, sample, token_seed


@dataclass(frozen=True)
class Row:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int = 0
    output_index: int = 0
    processing: LogitsProcessing | None = None


def _noise(rows, vocab: int, workers: int = 2) -> torch.Tensor | None:
    pending = DeviceSampler(workers).start(rows, vocab, torch.device("cpu"))
    return None if pending is None else pending.on(torch.device("cpu"))


def _batched(logits: torch.Tensor, rows) -> list[int]:
    return sample_tokens(logits, rows, _noise(rows, logits.shape[-1])).tolist()


def _logits(draw, rows: int, vocab: int, dtype: torch.dtype) -> torch.Tensor:
    """Random logits; on a coarse grid half the time, so rows hold many exact ties."""
    seed = draw(st.integers(0, 2**31 - 1))
    scale = draw(st.sampled_from([0.5, 3.0, 12.0]))
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale
    if draw(st.booleans()):
        logits = (logits * 2).round() / 2
    return logits.to(dtype)


_temperature = st.one_of(st.just(0.0), st.floats(0.05, 2.5))
_top_p = st.one_of(st.just(1.0), st.just(1e-6), st.floats(0.01, 1.0))
_min_p = st.one_of(st.just(0.0), st.floats(0.0, 1.0))


@st.composite
def _rows(draw, n: int, vocab: int) -> list[Row]:
    return [
        Row(
            temperature=draw(_temperature),
            top_p=draw(_top_p),
            top_k=draw(st.one_of(st.just(0), st.just(1), st.integers(0, vocab + 3))),
            min_p=draw(_min_p),
            seed=draw(st.integers(0, 2**63 - 1)),
            output_index=draw(st.integers(0, 5000)),
        )
        for _ in range(n)
    ]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), n=st.integers(1, 6), vocab=st.integers(2, 400))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_row_samples_the_per_row_samplers_token(data, n, vocab, dtype) -> None:
    logits = _logits(data.draw, n, vocab, dtype)
    rows = data.draw(_rows(n, vocab))
    assert _batched(logits, rows) == sample(logits, rows)


def test_a_large_vocabulary_with_ties_samples_the_same_tokens() -> None:
    vocab = 32_000
    logits = (torch.randn(12, vocab, generator=torch.Generator().manual_seed(3)) * 6).round()
    rows = [
        Row(0.0),
        Row(1.0, seed=1),
        Row(0.7, top_p=0.9, seed=2, output_index=9),
        Row(1.3, top_k=50, seed=3),
        Row(0.9, top_k=40, top_p=0.8, min_p=0.05, seed=4),
        Row(1.0, top_p=1e-6, seed=5),
        Row(2.0, min_p=0.3, seed=6),
        Row(0.0, top_k=5),
        Row(0.5, top_p=0.3, seed=7, output_index=1),
        Row(1.1, top_k=vocab, top_p=0.99, seed=8),
        Row(0.8, top_k=1, seed=9),
        Row(1.7, top_p=0.5, seed=10),
    ]
    assert _batched(logits, rows) == sample(logits, rows)


def test_the_nucleus_is_the_same_whether_its_mass_adds_up_in_fp32_or_fp64() -> None:
    """The CPU's fp32 cumsum adds in fp64 and rounds each sum, so the fp64 sum a GPU takes
    rounds to the same masses."""
    scores = torch.randn(16, 5000, generator=torch.Generator().manual_seed(2)) * 4
    top_p = torch.linspace(0.05, 0.99, 16).unsqueeze(-1)
    assert torch.equal(
        _outside_nucleus(scores, top_p, wide=True), _outside_nucleus(scores, top_p, wide=False)
    )


def test_the_noise_is_the_seeded_generators_stream_whoever_draws_it() -> None:
    rows = [Row(1.0, seed=s, output_index=i) for s, i in [(1, 0), (1, 1), (2**62, 7), (9, 3)]]
    rows.insert(2, Row(0.0))  # greedy rows draw nothing
    expected = []
    for row in rows:
        if row.temperature:
            generator = torch.Generator().manual_seed(token_seed(row.seed, row.output_index))
            expected.append(torch.empty(1000).exponential_(generator=generator))
    for workers in (1, 2, 3):
        assert torch.equal(_noise(rows, 1000, workers), torch.stack(expected))
    with torch.inference_mode():  # as the runner steps
        assert torch.equal(_noise(rows, 1000), torch.stack(expected))
    assert _noise([Row(0.0)], 1000) is None
    reused = torch.Generator()
    again = exponential_noise(torch.empty(1000), 1, 0, reused)
    assert torch.equal(exponential_noise(torch.empty(1000), 1, 0, reused), again)


def test_noise_of_the_wrong_shape_is_refused() -> None:
    logits = torch.zeros(2, 10)
    with pytest.raises(ValueError, match="need noise"):
        sample_tokens(logits, [Row(1.0), Row(0.0)])
    with pytest.raises(ValueError, match="need noise"):
        sample_tokens(logits, [Row(1.0), Row(1.0)], torch.ones(1, 10))


def test_the_handle_gives_the_ids_on_the_device_and_as_a_list() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    rows = [Row(0.0), Row(0.9, seed=4), Row(0.0)]
    sampler = DeviceSampler(2)
    handle = sampler.sample(logits, rows, sampler.start(rows, 50, logits.device))
    sampler.close()
    assert isinstance(handle, SampledTokens) and handle.ready()
    assert handle.tokens() == handle.ids.tolist() == sample(logits, rows)
    assert handle.logprobs() == {}


def _dense_reference(row: torch.Tensor, proc: LogitsProcessing) -> None:
    """The per-row dense pass the batched processing replaces, as it was written."""
    vocab = row.shape[-1]
    bias = [(t, b) for t, b in proc.logit_bias if t < vocab]
    if bias:
        ids, values = zip(*bias, strict=True)
        row.index_add_(0, torch.tensor(ids), torch.tensor(values, dtype=row.dtype))
    if proc.history and proc.repetition_penalty != 1.0:
        ids = torch.tensor(sorted({t for t in proc.history if t < vocab}), dtype=torch.long)
        scores = row.index_select(0, ids)
        penalty = proc.repetition_penalty
        row.index_copy_(0, ids, torch.where(scores < 0, scores * penalty, scores / penalty))
    if proc.presence_penalty or proc.frequency_penalty:
        output = [t for t in proc.history[proc.num_prompt_tokens :] if t < vocab]
        if output:
            counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=vocab)
            row -= proc.frequency_penalty * counts.to(row.dtype)
            row -= proc.presence_penalty * (counts > 0).to(row.dtype)
    banned = [t for t in proc.suppress if t < vocab]
    for words in proc.bad_words_ids:
        prefix = words[:-1]
        if not prefix or tuple(proc.history[len(proc.history) - len(prefix) :]) == prefix:
            banned.append(words[-1])
    banned = [t for t in banned if t < vocab]
    if banned:
        row[torch.tensor(banned, dtype=torch.long)] = float("-inf")


@st.composite
def _processing(draw, vocab: int) -> LogitsProcessing | None:
    if draw(st.booleans()):
        return None
    token = st.integers(0, vocab + 2)  # a few past the vocabulary, which are ignored
    history = tuple(draw(st.lists(token, max_size=30)))
    return LogitsProcessing(
        history=history,
        num_prompt_tokens=draw(st.integers(0, len(history))),
        repetition_penalty=draw(st.sampled_from([1.0, 1.3, 0.7, 2.0])),
        presence_penalty=draw(st.sampled_from([0.0, 0.4, -1.5])),
        frequency_penalty=draw(st.sampled_from([0.0, 0.5, -0.3, 2.0])),
        suppress=tuple(draw(st.lists(token, max_size=3))),
        bad_words_ids=tuple(
            tuple(w) for w in draw(st.lists(st.lists(token, min_size=1, max_size=3), max_size=3))
        ),
        logit_bias=tuple(
            draw(st.dictionaries(token, st.floats(-100, 100, width=32), max_size=4)).items()
        ),
        logprobs=draw(st.one_of(st.none(), st.integers(0, 6))),
    )


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), n=st.integers(1, 5), vocab=st.integers(2, 60))
def test_processing_and_logprobs_are_the_per_row_passes(data, n, vocab) -> None:
    logits = _logits(data.draw, n, vocab, torch.float32)
    rows = [
        Row(data.draw(_temperature), seed=i, processing=data.draw(_processing(vocab)))
        for i in range(n)
    ]
    expected = logits.clone()
    raw_expected = {}
    for i, row in enumerate(rows):
        if row.processing is not None:
            if row.processing.logprobs is not None:
                raw_expected[i] = torch.log_softmax(expected[i], dim=-1)
            _dense_reference(expected[i], row.processing)
    raw = process_logits(logits, rows)
    assert torch.equal(logits, expected)
    tokens = sample(expected, rows)
    sampler = DeviceSampler(2)
    handle = sampler.sample(logits, rows, sampler.start(rows, vocab, logits.device), raw)
    assert handle.tokens() == tokens
    got = handle.logprobs()
    assert got == {
        i: token_logprobs(lp[None], [tokens[i]], rows[i].processing.logprobs)[0]
        for i, lp in raw_expected.items()
    }
    assert (raw is None) == (not raw_expected)


def _per_row_sampling(self, logits, rows, noise, raw=None) -> SampledTokens:
    """``DeviceSampler.sample`` as the per-row sampler does it, for the engine test."""
    ids = torch.tensor(sample(logits, rows))
    return SampledTokens(ids, None if raw is None else raw.pick(ids))


ENGINE_PARAMS = [
    SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True),
    SamplingParams(max_tokens=12, temperature=1.2, top_k=20, min_p=0.02, seed=3, logprobs=2),
    SamplingParams(
        max_tokens=12, temperature=0.7, seed=11, repetition_penalty=1.3, frequency_penalty=0.4
    ),
    SamplingParams(max_tokens=12, temperature=0.0, presence_penalty=0.5, logprobs=0),
]


@pytest.mark.engine
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_engine_samples_the_per_row_samplers_tokens(llama_tiny, monkeypatch, dtype) -> None:
    prompts = ["Hello, my name is", "The capital of France", "a", "b c d", "x"]
    llm = quanta.LLM(str(llama_tiny), dtype=dtype, cache={"num_device_blocks": 64})
    got = llm.generate(prompts, ENGINE_PARAMS)
    monkeypatch.setattr(DeviceSampler, "sample", _per_row_sampling)
    expected = llm.generate(prompts, ENGINE_PARAMS)
    for g, e in zip(got, expected, strict=True):
        assert g.finish_reason == e.finish_reason == "length"
        assert g.token_ids == e.token_ids
        assert g.logprobs == e.logprobs
    assert got[1].token_ids != got[0].token_ids  # the seeded rows did sample
