"""Fill a meta-built model with seeded random weights, made where they will run.

Why: a real shape's benchmark on a GPU (LLaMA-3-8B, OPT-13B) needs its weights on the device,
not its values; writing 16-26 GB of random safetensors first and reading them back costs
minutes and disk a short-lived GPU machine does not have. This is vLLM's ``load_format``
"dummy": the runner builds the same skeleton as for a checkpoint (``build_model_skeleton``)
and each parameter is created straight on the device in the serving dtype, so the KV cache,
the kernels and the step are exactly a loaded engine's.

Values are HF's initialisation of a fresh model: normal(0, 0.02) matrices and embeddings,
zero biases, norm scales of one (zero where the norm adds the one itself, as Gemma's), so
activations stay finite through every layer. One generator on the device, seeded, walks the
parameters in their order, so a seed gives the same weights on the same device and dtype.
"""

from __future__ import annotations

import torch
from torch import nn

from quanta.families.spec import INIT_STD

DUMMY_SEED = 0


def fill_random_weights(
    model: nn.Module,
    *,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = DUMMY_SEED,
    std: float = INIT_STD,
) -> None:
    """Replace every (meta) parameter of ``model`` with random values on ``device``.

    A tied head is re-tied afterwards through ``model.tie_weights()``, as after loading."""
    generator = torch.Generator(device=device).manual_seed(seed)
    for owner in model.modules():
        for attr, param in list(owner.named_parameters(recurse=False)):
            value = torch.empty(param.shape, dtype=dtype, device=device)
            if attr == "bias":
                value.zero_()
            elif param.dim() == 1:  # a norm's scale (Gemma's norms add one to theirs)
                value.fill_(1.0 - getattr(owner, "offset", 0.0))
            else:
                value.normal_(0.0, std, generator=generator)
            owner._parameters[attr] = nn.Parameter(value, requires_grad=False)
    model.tie_weights()  # type: ignore[operator]
