"""``quanta bench quality``: does Quanta answer as the reference implementations do?

Three checks on one real model, each against a peer reading the same weights:
- greedy answers to chat questions in fp32 against HF transformers (token for token), and the
  share of bf16 answers equal to fp32's (bf16 rounds differently everywhere, so this is a
  figure to watch, not an identity);
- per-token log-probabilities of a fixed public-domain text against HF's, and the perplexity
  they give against HF's and llama.cpp's (llama-cpp-python, a benchmark-only peer run in its
  own virtual environment, at F16 on the same dequantized weights and on the file as shipped).

Quanta's figures come through its serving path (the offline API: scheduler, paged KV cache,
chunked prefill), not a bare forward pass, so what is checked is what a client gets.
"""

from __future__ import annotations

import json
import math
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from quanta_lab.bench.quality_data import CHAT_QUESTIONS, PERPLEXITY_TEXT


@dataclass
class GreedyComparison:
    """Greedy token ids of one system against a reference's, prompt by prompt."""

    identical: int
    total: int
    prefix_agreement: float  # mean share of each answer before the first differing token
    first_difference: list[int | None] = field(default_factory=list)


@dataclass
class QualityReport:
    model: str
    prompts: int
    max_tokens: int
    greedy_fp32_vs_hf: GreedyComparison | None = None
    greedy_bf16_vs_fp32: GreedyComparison | None = None
    # quantized engine -> its greedy answers against the float engine of its dtype
    greedy_quantized: dict[str, GreedyComparison] = field(default_factory=dict)
    text_tokens: int = 0
    max_logprob_diff_vs_hf: float | None = None
    perplexity: dict[str, float] = field(default_factory=dict)
    answers: dict[str, list[str]] = field(default_factory=dict)

    def to_json(self) -> str:
        from dataclasses import asdict

        return json.dumps(asdict(self), indent=2)


def chat_prompts(model_dir: Path, questions: Sequence[str] = CHAT_QUESTIONS) -> list[str]:
    """Each question as one user turn through the model's own chat template."""
    from quanta.frontends.openai.protocol import ChatMessage
    from quanta.text.chat_template import ChatTemplate

    template = ChatTemplate.from_model_dir(model_dir)
    return [template.render([ChatMessage(role="user", content=q)]) for q in questions]


def compare_greedy(got: Sequence[Sequence[int]], want: Sequence[Sequence[int]]) -> GreedyComparison:
    firsts: list[int | None] = []
    shares: list[float] = []
    for a, b in zip(got, want, strict=True):
        first = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
        if first is None and len(a) != len(b):
            first = min(len(a), len(b))
        firsts.append(first)
        shares.append(1.0 if first is None else first / max(len(b), 1))
    return GreedyComparison(
        identical=sum(f is None for f in firsts),
        total=len(firsts),
        prefix_agreement=sum(shares) / max(len(shares), 1),
        first_difference=firsts,
    )


# -- Quanta ----------------------------------------------------------------------------------
def load(engine: Path | Any) -> Any:
    """An offline ``LLM`` of the engine directory (one given already is used as it is), so a
    run that asks one engine several things loads it once."""
    from quanta.frontends.offline import LLM

    return engine if isinstance(engine, LLM) else LLM(str(engine))


def quanta_greedy(
    engine: Path | Any, prompts: Sequence[str | list[int]], max_tokens: int
) -> list[list[int]]:
    """Greedy answers (ending at EOS or ``max_tokens``), all prompts batched as served."""
    from quanta.core.request import SamplingParams

    llm = load(engine)
    results = llm.generate(list(prompts), SamplingParams(max_tokens=max_tokens, temperature=0.0))
    return [list(r.token_ids) for r in results]


def quanta_token_logprobs(engine: Path | Any, ids: Sequence[int]) -> list[float]:
    """log p(ids[i] | ids[:i]) for i >= 1, from the engine's prompt log-probabilities."""
    from quanta.core.request import SamplingParams

    llm = load(engine)
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    (result,) = llm.generate([list(ids)], params)
    return [lp.logprob for lp in result.prompt_logprobs]


def tokenize(engine: Path, text: str) -> list[int]:
    from quanta.text.tokenizer import load_tokenizer

    return load_tokenizer(engine).encode(text)


# -- HF transformers -------------------------------------------------------------------------
def hf_model(model_dir: Path) -> object:
    """The fp32 HF model of an engine directory (engines keep HF's layout and names)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.eval()
    return model


def hf_greedy(
    model: object, prompt_ids: Sequence[Sequence[int]], max_tokens: int, eos: Sequence[int]
) -> list[list[int]]:
    import torch

    out: list[list[int]] = []
    for ids in prompt_ids:
        x = torch.tensor([list(ids)])
        with torch.no_grad():
            y = model.generate(  # type: ignore[attr-defined]
                x,
                attention_mask=torch.ones_like(x),
                do_sample=False,
                max_new_tokens=max_tokens,
                eos_token_id=list(eos),
                pad_token_id=eos[0],
            )
        answer = y[0, x.shape[1] :].tolist()
        out.append(answer)
    return out


def hf_token_logprobs(model: object, ids: Sequence[int]) -> list[float]:
    import torch

    x = torch.tensor([list(ids)])
    with torch.no_grad():
        logits = model(x).logits[0].float()  # type: ignore[operator]
    logprobs = torch.log_softmax(logits[:-1], dim=-1)
    return logprobs.gather(1, x[0, 1:, None]).squeeze(1).tolist()


# -- llama.cpp -------------------------------------------------------------------------------
_LLAMA_CPP_SCRIPT = """
import json, sys
import numpy as np
from llama_cpp import Llama
args = json.load(sys.stdin)
ids = args["ids"]
llm = Llama(model_path=args["gguf"], n_ctx=len(ids) + 8, logits_all=True, n_threads=1,
            n_batch=512, verbose=False)
llm.eval(ids)
scores = np.asarray(llm.scores[: len(ids)], dtype=np.float64)
top = scores.max(axis=1, keepdims=True)
logz = top[:, 0] + np.log(np.exp(scores - top).sum(axis=1))
picked = scores[np.arange(len(ids) - 1), ids[1:]] - logz[:-1]
json.dump([float(v) for v in picked], sys.stdout)
"""


def llama_cpp_token_logprobs(python: Path, gguf: Path, ids: Sequence[int]) -> list[float]:
    """Run llama-cpp-python in its own interpreter (never imported here: a peer, not a
    dependency) and return its log-probabilities of ``ids[1:]``."""
    proc = subprocess.run(
        [str(python), "-c", _LLAMA_CPP_SCRIPT],
        input=json.dumps({"gguf": str(gguf), "ids": list(ids)}),
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"llama-cpp-python failed: {proc.stderr.strip()[-2000:]}")
    return [float(v) for v in json.loads(proc.stdout)]


def perplexity(logprobs: Sequence[float]) -> float:
    return math.exp(-sum(logprobs) / len(logprobs))


# -- the whole check -------------------------------------------------------------------------
def run_quality(
    gguf: Path,
    *,
    engine_fp32: Path,
    engine_bf16: Path | None,
    max_tokens: int = 48,
    llama_cpp_python: Path | None = None,
    with_hf: bool = True,
    quantized: dict[str, Path] | None = None,
    questions: int | None = None,
) -> QualityReport:
    """Every check this machine can run; peers that are not given are left out.

    ``quantized`` maps a label (``quanta-int4-bfloat16``) to a quantized engine of the same
    file: its perplexity joins the table and its greedy answers are compared with the float
    engine of its dtype. ``questions`` keeps the first so many chat questions (a quick look;
    the perplexity text is always whole)."""
    asked = CHAT_QUESTIONS[:questions]
    report = QualityReport(model=gguf.name, prompts=len(asked), max_tokens=max_tokens)
    prompts = chat_prompts(engine_fp32, asked)
    ids = [tokenize(engine_fp32, p) for p in prompts]
    fp32_llm = load(engine_fp32)
    fp32 = quanta_greedy(fp32_llm, ids, max_tokens)
    decode = _decoder(engine_fp32)
    report.answers["quanta-fp32"] = [decode(a) for a in fp32]
    text_ids = tokenize(engine_fp32, PERPLEXITY_TEXT)
    report.text_tokens = len(text_ids)
    ours = quanta_token_logprobs(fp32_llm, text_ids)
    report.perplexity["quanta-fp32"] = perplexity(ours)
    if engine_bf16 is not None:
        bf16_llm = load(engine_bf16)
        bf16 = quanta_greedy(bf16_llm, ids, max_tokens)
        report.answers["quanta-bf16"] = [decode(a) for a in bf16]
        report.greedy_bf16_vs_fp32 = compare_greedy(bf16, fp32)
        report.perplexity["quanta-bf16"] = perplexity(quanta_token_logprobs(bf16_llm, text_ids))
    for label, engine in (quantized or {}).items():
        q_llm = load(engine)
        answers = quanta_greedy(q_llm, ids, max_tokens)
        report.answers[label] = [decode(a) for a in answers]
        float_answers = bf16 if engine_bf16 is not None and "bfloat16" in label else fp32
        report.greedy_quantized[label] = compare_greedy(answers, float_answers)
        report.perplexity[label] = perplexity(quanta_token_logprobs(q_llm, text_ids))
        del q_llm
    if with_hf:
        from quanta.runner.models.config import load_model_config

        model = hf_model(engine_fp32)
        eos = load_model_config(engine_fp32).eos_token_ids
        hf = hf_greedy(model, ids, max_tokens, eos)
        report.answers["hf-fp32"] = [decode(a) for a in hf]
        report.greedy_fp32_vs_hf = compare_greedy(fp32, hf)
        theirs = hf_token_logprobs(model, text_ids)
        report.max_logprob_diff_vs_hf = max(abs(a - b) for a, b in zip(ours, theirs, strict=True))
        report.perplexity["hf-fp32"] = perplexity(theirs)
    if llama_cpp_python is not None:
        import gguf as gguf_lib
        from quanta.build.gguf_export import write_gguf
        from quanta.build.gguf_import import gguf_label, gguf_to_checkpoint

        report.perplexity[f"llama.cpp-{gguf_label(gguf)}"] = perplexity(
            llama_cpp_token_logprobs(llama_cpp_python, gguf, text_ids)
        )
        with tempfile.TemporaryDirectory(prefix="quanta-quality-") as tmp:
            checkpoint = Path(tmp) / "hf"
            checkpoint.mkdir()
            gguf_to_checkpoint(gguf, checkpoint)
            f16 = Path(tmp) / "f16.gguf"
            write_gguf(checkpoint, f16, qtype=gguf_lib.GGMLQuantizationType.F16)
            report.perplexity["llama.cpp-F16"] = perplexity(
                llama_cpp_token_logprobs(llama_cpp_python, f16, text_ids)
            )
    return report


def _decoder(engine: Path) -> Callable[[Sequence[int]], str]:
    """Text of token ids with the engine's tokenizer, loaded once."""
    from quanta.text.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(engine)
    return lambda ids: tokenizer.decode(list(ids))
