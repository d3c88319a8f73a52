"""Speculative decoding by prompt lookup: proposals, the block ledger, and invariance.

The hashing fake runner verifies drafts as a model does (a draft counts while it equals what
the context before it hashes to), over a three-token vocabulary, so its outputs repeat and
prompt lookup proposes and accepts often; any bookkeeping slip (a rejected draft's slot kept,
a block named or freed wrongly, a draft counted as computed) changes the tokens, which must
equal those of plain decoding, under every policy and under memory pressure.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError
from quanta.core.request import Request, RequestMetadata, RequestStatus, SamplingParams
from quanta.core.speculative import (
    Proposer,
    SpeculativeConfig,
    learn,
    propose_ngram,
    speculates,
)
from quanta.runner.sampler import sample_row
from quanta.runner.speculative import verify

SPEC = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=3, prompt_lookup_min=1)


def reference_ngram(tokens: list[int], k: int, n_min: int, n_max: int) -> tuple[int, ...]:
    """The definition, by brute force: longest suffix first, latest earlier occurrence."""
    for n in range(min(n_max, len(tokens) - 1), n_min - 1, -1):
        suffix = tokens[len(tokens) - n :]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                seq = list(tokens)
                for i in range(k):  # the occurrence's continuation, as the tokens go on
                    seq.append(seq[start + n + i])
                return tuple(seq[len(tokens) :])
    return ()


def test_prompt_lookup_takes_the_latest_longest_match() -> None:
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]
    assert propose_ngram(tokens, 3, 1, 3) == (7, 8, 5)  # the latest "1 2 3", not the first
    assert propose_ngram(tokens, 5, 1, 3) == (7, 8, 5, 1, 2)
    assert propose_ngram(tokens, 2, 4, 4) == ()  # no earlier "3 1 2 3"
    assert propose_ngram([5, 6, 7], 4, 1, 3) == ()
    assert propose_ngram([4, 4, 4, 4], 2, 1, 2) == (4, 4)
    assert propose_ngram([7, 7], 0, 1, 1) == ()


@given(
    tokens=st.lists(st.integers(0, 300), min_size=0, max_size=60),
    k=st.integers(1, 6),
    n_min=st.integers(1, 3),
    extra=st.integers(0, 3),
)
def test_prompt_lookup_equals_its_definition(tokens: list[int], k: int, n_min: int, extra: int):
    # ids above 255 make multi-byte words, so unaligned byte matches are exercised
    tokens = [t * 257 if t % 3 == 0 else t for t in tokens]
    assert propose_ngram(tokens, k, n_min, n_min + extra) == reference_ngram(
        tokens, k, n_min, n_min + extra
    )


def test_config_is_vllms_and_refuses_what_it_cannot_serve() -> None:
    config = SpeculativeConfig.model_validate_json(
        '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4}'
    )
    assert (config.num_speculative_tokens, config.prompt_lookup_max) == (5, 4)
    with pytest.raises(ValidationError, match="not served"):
        SpeculativeConfig.model_validate({"method": "medusa"})
    with pytest.raises(ValidationError, match="must not exceed"):
        SpeculativeConfig(prompt_lookup_min=5, prompt_lookup_max=2)
    with pytest.raises(ValidationError):
        SpeculativeConfig(num_speculative_tokens=0)


def _decoding(params: SamplingParams, tokens: list[int]) -> Request:
    r = Request("r", tokens[:-1], params, 0.0, seed=0)
    r.set_status(RequestStatus.RUNNING)
    r.num_computed_tokens = len(tokens) - 1
    r.append_token(tokens[-1], 0.0)
    r.num_computed_tokens = len(tokens) - 1
    return r


def test_only_plain_decodes_speculate_and_never_past_max_tokens() -> None:
    tokens = [1, 2, 3, 4, 5, 1, 2, 3]
    plain = _decoding(SamplingParams(max_tokens=3), tokens)
    assert speculates(plain)
    Proposer(SPEC, max_model_len=64).propose([plain], num_running=1)
    # one output token so far, max_tokens 3: one draft, so the step ends at max_tokens
    assert plain.draft_token_ids == (4,)
    assert plain.num_uncomputed_tokens == 2
    for params in (
        SamplingParams(logprobs=0),
        SamplingParams(repetition_penalty=1.2),
        SamplingParams(min_tokens=5),
        SamplingParams(logit_bias={3: 1.0}),
    ):
        assert not speculates(_decoding(params, tokens))
    assert speculates(_decoding(SamplingParams(max_tokens=3, min_p=0.2), tokens))
    crowded = _decoding(SamplingParams(max_tokens=30), tokens)
    Proposer(SPEC.model_copy(update={"disable_by_batch_size": 2}), 64).propose([crowded], 3)
    assert crowded.draft_token_ids == ()


def test_drafts_that_keep_failing_back_off_and_good_ones_grow() -> None:
    r = _decoding(SamplingParams(max_tokens=100), [1, 2, 3, 1, 2, 3, 1, 2])
    proposer = Proposer(SPEC, max_model_len=256)
    skipped = []
    for _ in range(4):  # every draft refused: sit out 1, 2, 4, 8 steps, then one draft
        learn(r, 1, 0)
        n = 0
        while True:
            proposer.propose([r], 1)
            if r.draft_token_ids:
                break
            n += 1
        skipped.append(n)
        assert r.draft_token_ids == (3,)
    assert skipped == [1, 2, 4, 8]
    learn(r, 1, 1)  # accepted: one more each time, up to the configured four
    proposer.propose([r], 1)
    assert r.draft_token_ids == (3, 1)
    learn(r, 2, 2)
    learn(r, 3, 3)
    learn(r, 4, 4)
    proposer.propose([r], 1)
    assert len(r.draft_token_ids) == 4
    learn(r, 4, 1)  # partly accepted: one more than were
    proposer.propose([r], 1)
    assert len(r.draft_token_ids) == 2


def _run(make_loop, policy: str, spec: SpeculativeConfig | None, **kwargs):
    options = {"safepoints": False} if policy == "conserve" else None
    loop = make_loop(policy=policy, speculative=spec, vocab=3, policy_options=options, **kwargs)
    reqs = [
        Request(
            f"r{i}",
            [(i * 5 + j) % 3 for j in range(5 + 3 * i)],
            SamplingParams(max_tokens=24 + i, temperature=0.0 if i % 2 else 0.8),
            float(i) * 1e-3,
            seed=i,
            metadata=RequestMetadata(
                tenant=f"t{i % 2}", priority_class="offline" if i % 3 == 2 else "online"
            ),
        )
        for i in range(6)
    ]
    streams = [loop.submit(r) for r in reqs]
    loop.run_until_idle()
    outs = {r.request_id: list(r.output_token_ids) for r in reqs}
    assert all(r.finish_reason in ("length", "stop") for r in reqs), [r.error for r in reqs]
    for s in streams:
        assert s is not None
    return outs, loop.stats()


@pytest.mark.parametrize("policy", ["fcfs", "sj-mlfq", "conserve", "fair"])
@pytest.mark.parametrize("device_blocks", [64, 14])
def test_outputs_equal_plain_decoding_under_every_policy(make_loop, policy, device_blocks):
    """Tight pools preempt (swap and recompute) mid-speculation; the tokens must not move."""
    kwargs = {"device": device_blocks, "host": 64, "block_size": 4, "max_model_len": 64}
    plain, _ = _run(make_loop, policy, None, **kwargs)
    spec, stats = _run(make_loop, policy, SPEC, **kwargs)
    assert spec == plain
    assert stats.spec_num_accepted_tokens > 0  # drafts did land, so the check means something
    assert stats.spec_num_draft_tokens > stats.spec_num_accepted_tokens  # and some were refused
    if device_blocks == 14:
        assert stats.num_preemptions_swap + stats.num_preemptions_recompute > 0


DRAFT = SpeculativeConfig(method="draft_model", model="a draft", num_speculative_tokens=3)


@pytest.mark.parametrize("policy", ["fcfs", "sj-mlfq", "conserve"])
@pytest.mark.parametrize("prefix_caching", [False, True])
def test_draft_model_proposals_keep_outputs_and_return_their_slots(
    make_loop, policy, prefix_caching
):
    """The fake runner proposes as a draft model would (partly right), through lookahead
    slots it checks are reserved; tight pools preempt; tokens equal plain decoding's and
    every block comes back (the fixture checks)."""
    kwargs = {"device": 14, "host": 64, "block_size": 4, "max_model_len": 64}
    kwargs["prefix_caching"] = prefix_caching
    plain, _ = _run(make_loop, policy, None, **kwargs)
    spec, stats = _run(make_loop, policy, DRAFT, **kwargs)
    assert spec == plain
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens


def test_draft_model_config_follows_vllm() -> None:
    config = SpeculativeConfig.model_validate({"model": "engines/d", "num_speculative_tokens": 2})
    assert config.method == "draft_model"
    with pytest.raises(ValidationError, match="takes the draft"):
        SpeculativeConfig(method="draft_model")
    with pytest.raises(ValidationError, match="not served"):
        SpeculativeConfig.model_validate({"method": "eagle", "model": "x"})


def test_prefix_caching_and_speculation_together(make_loop) -> None:
    kwargs = {"device": 24, "host": 32, "block_size": 4, "max_model_len": 64}
    plain, _ = _run(make_loop, "fcfs", None, prefix_caching=True, **kwargs)
    spec, stats = _run(make_loop, "fcfs", SPEC, prefix_caching=True, **kwargs)
    assert spec == plain and stats.spec_num_accepted_tokens > 0


def test_a_short_token_budget_verifies_fewer_drafts(make_loop) -> None:
    """Drafts are optional: without chunked prefill a decode still runs when only it fits."""
    kwargs = {"device": 64, "host": 16, "block_size": 4, "max_model_len": 64}
    plain, _ = _run(
        make_loop, "fcfs", None, max_num_batched_tokens=24, enable_chunked_prefill=False, **kwargs
    )
    spec, stats = _run(
        make_loop, "fcfs", SPEC, max_num_batched_tokens=24, enable_chunked_prefill=False, **kwargs
    )
    assert spec == plain and stats.spec_num_accepted_tokens > 0


class _Row:
    def __init__(
        self,
        temperature: float,
        seed: int,
        top_k: int = 0,
        top_p: float = 1.0,
        min_p: float = 0.0,
    ):
        self.temperature, self.seed, self.top_k, self.top_p = temperature, seed, top_k, top_p
        self.min_p = min_p
        self.output_index = 3

    def at(self, index: int) -> _Row:
        row = _Row(self.temperature, self.seed, self.top_k, self.top_p, self.min_p)
        row.output_index = index
        return row


def test_greedy_verification_is_argmax_token_for_token() -> None:
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 1.0], [0.0, 0.0, 9.0]])
    assert verify(logits, (1, 0), _Row(0.0, 0)) == (2, 2)  # both accepted, then the bonus
    assert verify(logits, (1, 2), _Row(0.0, 0)) == (1, 0)  # the second refused: argmax instead
    assert verify(logits[:1], (), _Row(0.0, 0)) == (0, 1)


def test_sampled_verification_keeps_the_target_distribution() -> None:
    """Rejection sampling: the first token's frequencies over many seeds match the target
    probabilities (chi-square), whatever the draft; a draft is accepted with its target
    probability; one outside top-k never lands."""
    logits = torch.tensor([[1.0, 0.2, -0.5, 0.7], [0.0, 1.0, 0.0, 0.5], [0.3, 0.3, 0.3, 0.3]])
    target = torch.softmax(logits[0] / 0.9, -1)
    trials = 4000
    for draft in (0, 2):
        counts = torch.zeros(4)
        accepted = 0
        for seed in range(trials):
            n, token = verify(logits, (draft, 1), _Row(0.9, seed))
            counts[draft if n >= 1 else token] += 1
            accepted += n >= 1
        expected = target * trials
        chi2 = float(((counts - expected) ** 2 / expected).sum())
        assert chi2 < 16.3, (draft, counts.tolist(), expected.tolist())  # p = 0.001, 3 dof
        assert abs(accepted / trials - float(target[draft])) < 0.03
    for seed in range(200):
        n, token = verify(logits, (2, 1), _Row(0.9, seed, top_k=2))
        assert n == 0 and token in (0, 3)


def test_verification_draws_what_plain_sampling_draws() -> None:
    """Each position samples with its own stream, so the tokens equal plain decoding's."""
    torch.manual_seed(0)
    logits = torch.randn(4, 11)
    for seed in range(50):
        for row in (_Row(0.7, seed, top_p=0.9), _Row(1.5, seed, min_p=0.3)):
            plain = [sample_row(logits[i], row.at(row.output_index + i)) for i in range(4)]
            n, token = verify(logits, (*plain[:2], (plain[2] + 1) % 11), row)
            assert (n, token) == (2, plain[2])


# -- the real engine ---------------------------------------------------------------------------
ENGINE_SPEC = {"num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
PROMPTS = ["one two three one two three one", "Hello, Quanta", "a b a b a b a b", "x y z"]


@pytest.mark.engine
@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=40, temperature=0.0),
        SamplingParams(max_tokens=40, temperature=0.3, top_k=2, seed=7),
    ],
    ids=["greedy", "seeded"],
)
def test_real_engine_outputs_equal_plain_decoding(llama_tiny, params) -> None:
    """On the PyTorch engine (fp32, llama-tiny: grouped-query attention), with a roomy pool,
    with one so small that requests swap and recompute mid-speculation, and with the prefix
    cache on: the same tokens as plain decoding, and drafts accepted."""
    from quanta import LLM

    plain = LLM(str(llama_tiny), dtype="float32", enable_prefix_caching=False)
    want = [r.token_ids for r in plain.generate(PROMPTS, params)]
    for cache in ({"num_device_blocks": 64}, {"num_device_blocks": 8, "block_size": 8}):
        spec = LLM(str(llama_tiny), dtype="float32", cache=cache, speculative_config=ENGINE_SPEC)
        assert [r.token_ids for r in spec.generate(PROMPTS, params)] == want, cache
        stats = spec.engine.loop.stats()
        assert stats.spec_num_accepted_tokens > 0
        assert spec.engine.loop.blocks.all_free()
        if cache["num_device_blocks"] == 8:
            assert stats.num_preemptions_swap + stats.num_preemptions_recompute > 0


@pytest.mark.engine
def test_real_draft_model_keeps_the_targets_output(llama_tiny, tmp_path) -> None:
    """A draft model on the PyTorch engine: the target itself (every greedy proposal right)
    and another checkpoint of the same vocabulary (seed 1: mostly wrong), with swaps and
    recomputes in a tight pool; the tokens are plain decoding's either way."""
    from quanta import LLM
    from quanta.build.checkpoint import ensure_checkpoint

    other = ensure_checkpoint("llama-tiny", tmp_path / "draft", seed=1)
    params = SamplingParams(max_tokens=40, temperature=0.0)
    want = [r.token_ids for r in LLM(str(llama_tiny), dtype="float32").generate(PROMPTS, params)]
    for draft, cache in ((llama_tiny, 256), (llama_tiny, 10), (other, 10)):
        llm = LLM(
            str(llama_tiny),
            dtype="float32",
            cache={"num_device_blocks": cache, "block_size": 8},
            speculative_config={"model": str(draft), "num_speculative_tokens": 3},
        )
        assert [r.token_ids for r in llm.generate(PROMPTS, params)] == want, (draft, cache)
        stats = llm.engine.loop.stats()
        assert stats.spec_num_draft_tokens > 0 and llm.engine.loop.blocks.all_free()
        if draft == llama_tiny:
            assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens
        if cache == 10:
            assert stats.num_preemptions_swap + stats.num_preemptions_recompute > 0


def test_a_bad_speculative_config_is_refused_by_name(tmp_path) -> None:
    """config.pbtxt and ``quanta serve --speculative-config`` name the field at fault."""
    from quanta.cli import app
    from quanta.frontends.triton.settings import ConfigParameterError, parse_parameters
    from typer.testing import CliRunner

    engine, _ = parse_parameters(
        {"model_dir": "m", "speculative_config": '{"num_speculative_tokens": 3}'}, cwd=tmp_path
    )
    assert engine.speculative_config == SpeculativeConfig(num_speculative_tokens=3)
    with pytest.raises(ConfigParameterError, match=r"speculative_config\.prompt_lookup_min"):
        parse_parameters(
            {"model_dir": "m", "speculative_config": '{"prompt_lookup_min": 0}'}, cwd=tmp_path
        )
    result = CliRunner().invoke(app, ["serve", "--speculative-config", '{"method": "medusa"}'])
    words = " ".join(result.output.replace("│", " ").split())  # rich boxes and wraps it
    assert result.exit_code == 2 and "'medusa' is not served" in words, result.output
