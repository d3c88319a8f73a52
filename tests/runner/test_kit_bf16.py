"""bf16 within HF's own bf16 rounding, for every family: the engine in bf16 is as close to HF
transformers in fp32 as HF transformers in bf16 is.

Why a bound and not equality: bf16 keeps 8 bits of mantissa, so two correct bf16
implementations differ wherever they order a sum or fuse a product differently; HF's bf16
model is itself one such implementation. On a random-weight checkpoint transformers writes from
each family's config, logits of HF fp32 are the reference; the engine's bf16 logits must stay
within ``K`` times HF bf16's distance to it (plus a small floor for rows HF happens to round
well), at the prompt's last position (prefill) and over several one-token decode steps fed the
same tokens. Sliding windows of 8 tokens are outgrown by the prompt.

Greedy tokens are then held equal to HF bf16's at every step whose reference top-2 margin is
wider than both sides' rounding (on the shared context), and the engine's own greedy run up to
the first step that is not: where two tokens are that close, either bf16 model may pick either,
and a flip says nothing about correctness (everything after it differs by construction).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from quanta.core.output import ScheduledSeq, SchedulerOutput
from quanta.runner import ModelRunner
from runner_helpers import TINY_KIT_CONFIG, FakeRequest, ToyScheduler, hf_greedy, widen_weights

pytestmark = pytest.mark.engine

WINDOW = 8
PROMPT_LEN = 21
DECODE_STEPS = 10
# The engine's rounding may be this many times HF bf16's (its kernels sum in other orders).
K = 3.0
# A floor, relative to the reference's largest logit, for rows where HF bf16 rounds luckily.
FLOOR = 0.01
COMMON = TINY_KIT_CONFIG
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": COMMON,
    "qwen2": COMMON,
    "qwen3": COMMON | {"head_dim": 16},
    "mistral": COMMON | {"head_dim": 16, "sliding_window": WINDOW},
    "phi3": COMMON | {"pad_token_id": 0},
    "gemma2": COMMON | {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": WINDOW},
    "opt": {
        "vocab_size": 512,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "ffn_dim": 128,
        "word_embed_proj_dim": 64,
        "max_position_embeddings": 256,
    },
}
# Windowed and soft-capped layers as the AMX prefill kernel serves them: heads of 32
# columns, blocks of 16 keys (the kernel serves neither 16-column heads nor 4-key blocks).
AMX = {"head_dim": 32, "sliding_window": WINDOW}
FAMILIES |= {
    "mistral-amx": COMMON | AMX,
    "gemma2-amx": COMMON | AMX | {"query_pre_attn_scalar": 32},
}


SEEDS = {family: i for i, family in enumerate(FAMILIES)}


def _hf_model(family: str, path: Path, seed: int) -> Any:
    """A tiny random fp32 model written by transformers from the family's config."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(family.removesuffix("-amx"), **FAMILIES[family])
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    widen_weights(model)
    model.save_pretrained(path, safe_serialization=True)
    return model


def _prompt(seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, 500, (PROMPT_LEN,), generator=gen).tolist()


def _runner(path: Path, family: str) -> ModelRunner:
    amx = family.endswith("-amx")
    runner = ModelRunner(
        path, num_device_blocks=16, num_host_blocks=0, block_size=16 if amx else 4, dtype="bfloat16"
    )
    if amx and runner.prefill_attention != "amx":
        pytest.skip("no AMX prefill kernel here")
    return runner


def _engine_logits(
    runner: ModelRunner, tokens: list[int], monkeypatch: pytest.MonkeyPatch
) -> torch.Tensor:
    """The logits the engine samples from, one row per token after the prompt: the prefill's,
    then each one-token decode step's, fed ``tokens`` (not its own picks, so both sides see
    the same context)."""
    captured: list[torch.Tensor] = []
    project = runner.model.compute_logits

    def capture(hidden: torch.Tensor) -> torch.Tensor:
        logits = project(hidden)
        captured.append(logits.float())
        return logits

    monkeypatch.setattr(runner.model, "compute_logits", capture)
    table = tuple(range(-(-len(tokens) // runner.block_size)))
    spans = [(0, PROMPT_LEN)] + [(i, i + 1) for i in range(PROMPT_LEN, len(tokens))]
    for start, end in spans:
        seq = ScheduledSeq(
            request_id="r",
            token_ids=tuple(tokens[start:end]),
            start_pos=start,
            block_table=table,
            sample=True,
            temperature=0.0,
            top_p=1.0,
            top_k=0,
            seed=0,
            output_index=end - PROMPT_LEN,
        )
        runner.execute(SchedulerOutput(seqs=(seq,)))
    return torch.cat(captured)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_bf16_is_within_hf_bf16_rounding(
    family: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hf32 = _hf_model(family, tmp_path, seed=SEEDS[family])
    hf16 = copy.deepcopy(hf32).to(torch.bfloat16)
    prompt = _prompt(seed=SEEDS[family])
    hf_tokens = hf_greedy(hf16, prompt, DECODE_STEPS)
    tokens = prompt + hf_tokens[: DECODE_STEPS - 1]  # each row predicts the next token
    rows = slice(PROMPT_LEN - 1, len(tokens))
    with torch.no_grad():
        ref = hf32(torch.tensor([tokens])).logits[0, rows].float()
        theirs = hf16(torch.tensor([tokens])).logits[0, rows].float()
    ours = _engine_logits(_runner(tmp_path, family), tokens, monkeypatch)
    hf_err = (theirs - ref).abs().amax(dim=-1)
    our_err = (ours - ref).abs().amax(dim=-1)
    floor = FLOOR * ref.abs().max().item()
    for phase, at in (("prefill", slice(0, 1)), ("decode", slice(1, None))):
        bound = K * hf_err[at].max().item() + floor
        worst = our_err[at].max().item()
        assert worst <= bound, f"{family} {phase}: max |ours - fp32| {worst:.4f} > {bound:.4f}"

    # Greedy: where the reference's top-2 margin is wider than either side's rounding, the
    # engine picks HF bf16's token, step by step on the shared context and from its own sampler.
    top2 = ref.topk(2, dim=-1).values
    decided = top2[:, 0] - top2[:, 1] > 2 * torch.maximum(hf_err, our_err)
    assert decided.sum() >= 3, f"{family}: near-ties almost everywhere; widen the weights"
    picks = ours.argmax(dim=-1)
    for step in decided.nonzero().flatten().tolist():
        assert picks[step] == hf_tokens[step], f"{family}: step {step}"
    leading = int(decided.long().cumprod(0).sum().item())
    got = ToyScheduler(_runner(tmp_path, family), [FakeRequest("r", prompt, DECODE_STEPS)]).run()[
        "r"
    ]
    assert got[:leading] == hf_tokens[:leading], family
