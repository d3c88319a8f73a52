"""The engine's speed paths keep its answers: prepacked oneDNN linears against torch's, bf16
against HF transformers in bf16 (within a stated tolerance, not bit equality), and the rule
that picks the default dtype on each machine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from quanta.runner import ModelRunner, model_runner
from quanta.runner import cpu as cpu_module
from quanta.runner.linear import PackedLinear, onednn_supports, resolve_kernel
from runner_helpers import build_hf_checkpoint
from torch import nn

CPU = torch.device("cpu")
needs_onednn = pytest.mark.skipif(
    not onednn_supports(torch.float32, CPU), reason="torch has no oneDNN here"
)
needs_bf16 = pytest.mark.skipif(
    not onednn_supports(torch.bfloat16, CPU), reason="this CPU's oneDNN runs no bf16"
)
PROMPTS = [[5, 17, 42, 8, 99, 3, 250, 11], list(range(3, 40)), [7]]


@pytest.fixture(scope="module", params=["opt", "llama"])
def checkpoint(request, tmp_path_factory) -> tuple[Path, Any]:
    path = tmp_path_factory.mktemp(request.param)
    return path, build_hf_checkpoint(request.param, path, seed=3)


def runner(path: Path, **kwargs: Any) -> ModelRunner:
    return ModelRunner(path, num_device_blocks=16, num_host_blocks=0, **kwargs)


@needs_onednn
def test_packed_linears_replace_every_projection_and_match_torch(checkpoint):
    path, _ = checkpoint
    packed = runner(path, dtype="float32", linear_kernel="onednn")
    plain = runner(path, dtype="float32", linear_kernel="torch")
    assert packed.linear_kernel == "onednn" and plain.linear_kernel == "torch"
    assert not any(isinstance(m, nn.Linear) for m in packed.model.modules())
    assert any(isinstance(m, PackedLinear) for m in packed.model.modules())
    # the unpacked weights are gone: no projection keeps a second copy
    assert not any(name.endswith("proj.weight") for name, _ in packed.model.named_parameters())
    for prompt in PROMPTS:
        for chunk in (None, 3):
            a = packed.forward_logits(prompt, chunk_size=chunk)
            b = plain.forward_logits(prompt, chunk_size=chunk)
            assert (a - b).abs().max().item() < 1e-4


@needs_bf16
def test_bf16_agrees_with_hf_in_bf16(checkpoint):
    """Tolerance: the two compute in bf16 with different kernels and rounding points, so
    logits may differ by a few bf16 steps of their scale; the argmax of at least 90% of
    positions must agree."""
    path, hf = checkpoint
    ours = runner(path, dtype="bfloat16")
    hf_bf16 = hf.to(torch.bfloat16)
    try:
        agree = total = 0
        for prompt in PROMPTS:
            got = ours.forward_logits(prompt)
            with torch.no_grad():
                want = hf_bf16(torch.tensor([prompt])).logits[0].float()
            scale = want.abs().max().item()
            assert (got - want).abs().max().item() < 0.05 * scale
            agree += int((got.argmax(-1) == want.argmax(-1)).sum())
            total += len(prompt)
        assert agree >= 0.9 * total
    finally:
        hf.to(torch.float32)


def test_default_dtype_is_the_machines_fastest(monkeypatch):
    monkeypatch.delenv(model_runner.DEFAULT_DTYPE_ENV, raising=False)
    cpu_module.cpu_flags.cache_clear()
    monkeypatch.setattr(model_runner, "has_fast_bf16", lambda: False)
    assert model_runner.default_dtype(CPU) == torch.float32
    monkeypatch.setattr(model_runner, "has_fast_bf16", lambda: True)
    expected = torch.bfloat16 if onednn_supports(torch.bfloat16, CPU) else torch.float32
    assert model_runner.default_dtype(CPU) == expected
    assert model_runner.default_dtype(torch.device("cuda")) == torch.float16
    assert model_runner.resolve_dtype("float32", CPU) == torch.float32  # explicit wins
    monkeypatch.setenv(model_runner.DEFAULT_DTYPE_ENV, "float32")
    assert model_runner.default_dtype(CPU) == torch.float32
    monkeypatch.setenv(model_runner.DEFAULT_DTYPE_ENV, "fp8")
    with pytest.raises(ValueError, match="QUANTA_DEFAULT_DTYPE='fp8' is not a dtype"):
        model_runner.default_dtype(CPU)


def test_cpu_isa_names_a_path():
    assert cpu_module.cpu_isa()  # amx_bf16, avx512_bf16, avx512f, avx2 or the machine's name


def test_linear_kernel_rule():
    cuda = torch.device("cuda")
    assert resolve_kernel("auto", torch.float16, cuda) == "torch"
    assert resolve_kernel("torch", torch.float32, CPU) == "torch"
    with pytest.raises(ValueError, match="linear_kernel=onednn needs a CPU"):
        resolve_kernel("onednn", torch.float16, cuda)
    if onednn_supports(torch.float32, CPU):
        assert resolve_kernel("auto", torch.float32, CPU) == "onednn"
