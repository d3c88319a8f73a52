"""Penalties, min_tokens, bad words, logit bias, min-p and logprobs on real tiny checkpoints:
HF transformers' logits processors are the reference where HF has one (repetition penalty,
min new tokens, bad words, sequence bias, min-p, scores), OpenAI's formula where it has none
(presence/frequency), and outputs stay identical under preemption."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import quanta
import torch
from preemption import roomy_and_cramped
from pydantic import ValidationError
from quanta import SamplingParams
from quanta.core.errors import InvalidRequestError
from quanta.core.output import LogitsProcessing
from quanta.runner.logits import process_logits
from quanta.runner.sampler import filter_min_p, filter_top_k_top_p

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.engine

PROMPTS = ["Hello, my name is", "The capital of France", "a"]
N = 16


@pytest.fixture(scope="module", params=["opt-tiny", "llama-tiny"])
def model_dir(request, tiny_checkpoint):
    return tiny_checkpoint(request.param)


@pytest.fixture(scope="module")
def hf(model_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


@pytest.fixture(scope="module")
def llm(model_dir):
    return quanta.LLM(str(model_dir), cache={"num_device_blocks": 64})


def hf_generate(hf, llm, prompt: str, **kwargs) -> list[int]:
    ids = torch.tensor([llm.tokenizer.encode(prompt)])
    out = hf.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=N,
        pad_token_id=0,
        **kwargs,
    )
    return out[0, ids.shape[1] :].tolist()


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=N, temperature=0.0, **kwargs)


def test_repetition_penalty_matches_hf(hf, llm):
    changed = 0
    for prompt in PROMPTS:
        got = llm.generate(prompt, greedy(repetition_penalty=1.8, ignore_eos=True))[0]
        assert got.token_ids == hf_generate(hf, llm, prompt, repetition_penalty=1.8)
        plain = llm.generate(prompt, greedy(ignore_eos=True))[0]
        changed += got.token_ids != plain.token_ids
    assert changed  # the penalty does something


def test_min_tokens_holds_back_stop_tokens_like_hf_min_new_tokens(hf, llm):
    prompt = PROMPTS[0]
    plain = llm.generate(prompt, greedy(ignore_eos=True))[0].token_ids
    stop = plain[2]  # a token greedy decoding reaches early
    early = llm.generate(prompt, greedy(stop_token_ids=(stop,)))[0]
    assert early.finish_reason == "stop" and len(early.token_ids) <= 3
    held = llm.generate(prompt, greedy(stop_token_ids=(stop,), min_tokens=8, ignore_eos=True))[0]
    assert len(held.token_ids) > 8 or stop not in held.token_ids[:8]
    assert stop not in held.token_ids[:8]
    reference = hf_generate(hf, llm, prompt, eos_token_id=stop, min_new_tokens=8)
    assert held.token_ids == reference


def test_bad_words_match_hf(hf, llm):
    prompt = PROMPTS[1]
    plain = llm.generate(prompt, greedy(ignore_eos=True))[0].token_ids
    bad = ((plain[0],), (plain[3], plain[4]))
    got = llm.generate(prompt, greedy(bad_words_ids=bad, ignore_eos=True))[0].token_ids
    assert plain[0] not in got
    assert got == hf_generate(hf, llm, prompt, bad_words_ids=[list(b) for b in bad])


def test_presence_and_frequency_penalties_follow_openais_formula(hf, llm):
    prompt = PROMPTS[0]
    params = greedy(presence_penalty=0.7, frequency_penalty=1.3, ignore_eos=True)
    got = llm.generate(prompt, params)[0].token_ids
    ids = llm.tokenizer.encode(prompt)
    out: list[int] = []
    with torch.no_grad():
        for _ in range(N):
            logits = hf(torch.tensor([ids + out])).logits[0, -1].float()
            counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=len(logits))
            logits = logits - 1.3 * counts - 0.7 * (counts > 0).float()
            out.append(int(logits.argmax()))
    assert got == out
    plain = llm.generate(prompt, greedy(ignore_eos=True))[0].token_ids
    if len(set(plain)) < len(plain):  # greedy repeats a token: the penalties must change it
        assert got != plain


def test_logprobs_are_hfs_log_softmax_of_the_raw_scores(hf, llm):
    prompt = PROMPTS[2]
    got = llm.generate(prompt, greedy(logprobs=3, repetition_penalty=1.5, ignore_eos=True))[0]
    assert len(got.logprobs) == len(got.token_ids) == N
    ids = llm.tokenizer.encode(prompt)
    with torch.no_grad():
        logits = hf(torch.tensor([ids + got.token_ids[:-1]])).logits[0, len(ids) - 1 :]
    raw = torch.log_softmax(logits.float(), dim=-1)
    for i, (token, lp) in enumerate(zip(got.token_ids, got.logprobs, strict=True)):
        assert lp.logprob == pytest.approx(float(raw[i, token]), abs=1e-4)
        top = torch.topk(raw[i], 3)
        assert [t for t, _ in lp.top] == top.indices.tolist()
        assert [v for _, v in lp.top] == pytest.approx(top.values.tolist(), abs=1e-4)
    plain = llm.generate(prompt, greedy(ignore_eos=True))[0]
    assert plain.logprobs == ()


@pytest.mark.parametrize("chunk", [None, 3])
def test_prompt_logprobs_are_hfs_and_come_once_whatever_the_chunking(hf, model_dir, chunk):
    scheduler = {"max_num_batched_tokens": chunk} if chunk else None
    llm = quanta.LLM(str(model_dir), cache={"num_device_blocks": 64}, scheduler=scheduler)
    prompt = "The capital of France is Paris, and"
    got = llm.generate(prompt, greedy(prompt_logprobs=2))[0]
    ids = llm.tokenizer.encode(prompt)
    assert len(got.prompt_logprobs) == len(ids) - 1  # none for the first prompt token
    with torch.no_grad():
        raw = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    for i, lp in enumerate(got.prompt_logprobs):
        assert lp.logprob == pytest.approx(float(raw[i, ids[i + 1]]), abs=1e-4)
        top = torch.topk(raw[i], 2)
        assert [t for t, _ in lp.top] == top.indices.tolist()
    assert got.logprobs == ()  # asked for the prompt's only
    assert llm.generate(prompt, greedy())[0].prompt_logprobs == ()


def test_logit_bias_matches_hfs_sequence_bias_and_binds_greedy(hf, llm):
    prompt = PROMPTS[1]
    plain = llm.generate(prompt, greedy(ignore_eos=True))[0].token_ids
    bias = {plain[0]: -100.0, plain[3]: 2.5, 11: 1.5}
    got = llm.generate(prompt, greedy(logit_bias=bias, ignore_eos=True))[0].token_ids
    assert got[0] != plain[0]
    sequence_bias = [[[token], value] for token, value in bias.items()]
    assert got == hf_generate(hf, llm, prompt, sequence_bias=sequence_bias)
    forced = llm.generate(prompt, greedy(logit_bias={13: 100.0}, ignore_eos=True))[0]
    assert forced.token_ids == [13] * N


def test_min_p_and_the_other_filters_keep_what_hfs_warpers_keep(hf, llm):
    """Sequence bias, then temperature, top-k, top-p and min-p, as HF's processors run them:
    the same tokens survive, with the same scores."""
    ids = torch.tensor([llm.tokenizer.encode(PROMPTS[0])])
    with torch.no_grad():
        logits = hf(ids).logits[0, -1].float()
    bias = {int(logits.argmax()): -3.0, 17: 4.0}
    warpers = transformers.LogitsProcessorList(
        [
            transformers.SequenceBiasLogitsProcessor([[[t], b] for t, b in bias.items()]),
            transformers.TemperatureLogitsWarper(0.7),
            transformers.TopKLogitsWarper(40),
            transformers.TopPLogitsWarper(0.95),
            transformers.MinPLogitsWarper(0.1),
        ]
    )
    expected = warpers(ids, logits[None].clone())[0]
    ours = logits[None].clone()
    row = SimpleNamespace(processing=LogitsProcessing(logit_bias=tuple(bias.items())))
    process_logits(ours, [row])
    filtered = filter_top_k_top_p(ours[0] / 0.7, 40, 0.95)
    got = filter_min_p(filtered, 0.1)
    kept = torch.isfinite(expected)
    assert torch.equal(torch.isfinite(got), kept)
    assert torch.allclose(got[kept], expected[kept], atol=1e-5)
    assert kept.sum() < torch.isfinite(filtered).sum()  # min-p dropped some
    assert torch.equal(filter_min_p(filtered, 0.0), filtered)


def test_a_logit_bias_outside_the_vocabulary_is_refused(llm):
    vocab = llm.engine.model_config.vocab_size
    with pytest.raises(InvalidRequestError, match=rf"logit_bias: token ids \[{vocab}\]"):
        llm.generate("a", greedy(logit_bias={vocab: 1.0, 3: 1.0}))


@pytest.mark.parametrize(("host_blocks", "kind"), [(64, "swap"), (0, "recompute")])
def test_outputs_and_logprobs_survive_preemption(model_dir, host_blocks, kind):
    params = [
        greedy(repetition_penalty=1.4, logprobs=2, ignore_eos=True),
        SamplingParams(
            max_tokens=N, temperature=0.8, seed=3, frequency_penalty=0.5, presence_penalty=0.4
        ),
        greedy(min_tokens=10, bad_words_ids=((5,), (7, 9)), logprobs=0, prompt_logprobs=1),
        SamplingParams(
            max_tokens=N, temperature=1.2, seed=5, min_p=0.05, logit_bias={5: 3.0, 9: -100.0}
        ),
    ] * 2
    expected, got = roomy_and_cramped(
        model_dir, (PROMPTS + PROMPTS[:1]) * 2, params, host_blocks=host_blocks, device_blocks=14
    )
    for e, g in zip(expected, got, strict=True):
        assert e.error is None and g.error is None  # a failed request has nothing to compare
        assert e.token_ids and e.finish_reason in ("length", "stop")
        assert g.token_ids == e.token_ids and g.finish_reason == e.finish_reason
        assert [lp.logprob for lp in g.logprobs] == pytest.approx(
            [lp.logprob for lp in e.logprobs], abs=1e-5
        )
        # reported once, even where the prompt was recomputed after a preemption
        assert len(g.prompt_logprobs) == len(e.prompt_logprobs)
        assert [lp.logprob for lp in g.prompt_logprobs] == pytest.approx(
            [lp.logprob for lp in e.prompt_logprobs], abs=1e-5
        )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"repetition_penalty": 0}, "greater than 0"),
        ({"presence_penalty": 2.5}, "less than or equal to 2"),
        ({"frequency_penalty": -3}, "greater than or equal to -2"),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens (20) must not exceed max_tokens"),
        ({"logprobs": 21}, "less than or equal to 20"),
        ({"prompt_logprobs": -1}, "greater than or equal to 0"),
        ({"bad_words_ids": ((),)}, "bad_words_ids must be non-empty"),
        ({"min_p": 1.5}, "less than or equal to 1"),
        ({"min_p": -0.1}, "greater than or equal to 0"),
        ({"logit_bias": {5: 100.5}}, "bias 100.5 of token 5 must lie in [-100, 100]"),
        ({"logit_bias": {-1: 1.0}}, "token id -1 is negative"),
    ],
)
def test_bad_values_are_refused(kwargs, message):
    with pytest.raises(ValidationError, match=re.escape(message)):
        SamplingParams(**kwargs)
