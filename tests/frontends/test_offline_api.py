"""The offline API on real tiny checkpoints: HF parity through the whole loop, preemption
invariance on the real engine, seeded sampling, typed errors and block hygiene."""

from __future__ import annotations

import pytest
import quanta
import torch
from preemption import roomy_and_cramped
from quanta.core.errors import EmptyPromptError, PromptTooLongError
from runner_helpers import PROMPTS

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module", params=["opt-tiny", "llama-tiny"])
def model_dir(request, tiny_checkpoint):
    return tiny_checkpoint(request.param)


@pytest.fixture(scope="module")
def hf_greedy(model_dir):
    """HF transformers' greedy continuation of each prompt, run alone (no padding)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tok = quanta.LLM(str(model_dir), cache={"num_device_blocks": 8}).tokenizer
    out = {}
    for p in PROMPTS:
        ids = torch.tensor([tok.encode(p)])
        gen = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=24,
            pad_token_id=tok.eos_token_id,
        )
        out[p] = gen[0, ids.shape[1] :].tolist()
    return out


def _llm(model_dir, **kw):
    return quanta.LLM(str(model_dir), **kw)


def _assert_no_leak(llm):
    blocks = llm.engine.loop.blocks
    blocks.check_integrity()
    assert blocks.all_free()


@pytest.mark.parametrize("chunked", [True, False])
def test_greedy_matches_hf_batched(model_dir, hf_greedy, chunked):
    sched = {"enable_chunked_prefill": chunked, "max_num_batched_tokens": 8 if chunked else 512}
    llm = _llm(model_dir, scheduler=sched, cache={"num_device_blocks": 64})
    res = llm.generate(PROMPTS, quanta.SamplingParams(max_tokens=24, temperature=0))
    for p, r in zip(PROMPTS, res, strict=True):
        assert r.token_ids == hf_greedy[p], p
        assert r.text == llm.tokenizer.decode(r.token_ids)
        assert r.finish_reason in ("length", "stop")
    _assert_no_leak(llm)


@pytest.mark.parametrize(("host_blocks", "kind"), [(64, "swap"), (0, "recompute")])
def test_preemption_invariance_on_real_engine(model_dir, hf_greedy, host_blocks, kind):
    params = [quanta.SamplingParams(max_tokens=24, temperature=0)] * len(PROMPTS)
    params += [quanta.SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9, seed=7)] * 2
    prompts = PROMPTS + PROMPTS[:2]
    expected, got = roomy_and_cramped(
        model_dir, prompts, params, host_blocks=host_blocks, device_blocks=20
    )
    for e, g in zip(expected, got, strict=True):
        assert g.token_ids == e.token_ids
        assert g.text == e.text
    for p, r in zip(PROMPTS, got, strict=False):
        assert r.token_ids == hf_greedy[p]


def test_prompts_as_texts_or_token_ids_one_or_a_list(model_dir, hf_greedy):
    """As vLLM's ``LLM.generate``: one text or one list of ids is one prompt; a list of
    either is a batch, answered in order."""
    llm = _llm(model_dir)
    params = quanta.SamplingParams(max_tokens=8, temperature=0)
    ids = [llm.tokenizer.encode(p) for p in PROMPTS[:2]]
    batch = llm.generate(ids, params)
    assert [r.prompt for r in batch] == ids
    assert [r.token_ids for r in batch] == [hf_greedy[p][:8] for p in PROMPTS[:2]]
    [one] = llm.generate(ids[1], params)
    assert one.prompt == ids[1] and one.token_ids == batch[1].token_ids
    _assert_no_leak(llm)


def test_seeded_sampling_is_reproducible(model_dir):
    llm = _llm(model_dir)
    p = quanta.SamplingParams(max_tokens=16, temperature=1.0, top_k=20, seed=1234)
    a = llm.generate(PROMPTS, p)
    b = llm.generate(list(reversed(PROMPTS)), p)
    assert [r.token_ids for r in a] == [r.token_ids for r in reversed(b)]
    other = llm.generate(PROMPTS, p.model_copy(update={"seed": 99}))
    assert [r.token_ids for r in a] != [r.token_ids for r in other]
    _assert_no_leak(llm)


def test_stop_strings_and_typed_errors(model_dir):
    llm = _llm(model_dir)
    [full] = llm.generate(
        "Hello", quanta.SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    )
    if len(full.text) < 6:
        pytest.skip("continuation too short to pick a stop string")
    stop = full.text[3:6]
    [cut] = llm.generate(
        "Hello", quanta.SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop=[stop])
    )
    assert cut.text == full.text[: full.text.index(stop)]
    assert cut.finish_reason == "stop"
    with pytest.raises(EmptyPromptError):
        llm.generate("", quanta.SamplingParams())
    max_len = llm.engine.model_config.max_model_len
    with pytest.raises(PromptTooLongError):
        llm.generate("x" * (max_len + 10), quanta.SamplingParams())
    _assert_no_leak(llm)
