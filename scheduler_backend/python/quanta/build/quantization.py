"""Which tensors ``quanta build --quantization`` quantizes, and how they are written.

Every linear layer's weight is quantized (``quanta.runner.quantized.quantize``) and stored as
``X.qweight``, ``X.scales`` and (int4 asymmetric) ``X.zeros`` in place of ``X.weight``; the
embedding and norms stay in the serving dtype, and the LM head is quantized only when asked
(its logits decide every token, and a tied head shares the embedding's table, which would
then be stored twice: once as the float lookup table, once quantized). A tied head that is
quantized is written under ``lm_head`` from the embedding's tensor.

With ``--quantize-embedding`` the token embedding's table is quantized too, as a linear's
weight is (one row per token: int8 scales per token, int4 groups along the hidden size), and
stored under the embedding's own name; a lookup dequantizes the rows it reads. A tied head is
then that same quantized table, stored once (in the head's mode), as a float tied model
stores its table once: the one way to shrink a tied model's largest tensor without holding
it twice.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import torch
from torch import nn

from quanta.build.manifest import MANIFEST_FILE, Quantization
from quanta.runner.quantized import QUANT_SUFFIXES, QuantizedWeight, quantize

if TYPE_CHECKING:  # the build imports this module
    from quanta.build.engine_build import BuildOptions
    from quanta.build.gguf_kept import GgufKept
    from quanta.runner.models.config import ModelConfig

QuantMode = Literal["int8", "int4", "keep"]
# TensorRT-LLM's spelling (--use_weight_only --weight_only_precision int8|int4).
TRTLLM_ALIASES = {"int8": "int8", "int4": "int4", "int4_awq": "int4"}


@dataclass(frozen=True)
class QuantPlan:
    """The quantization asked of one build: ``mode`` int8 or int4, ``linears`` the weight
    names to quantize (``X.weight``), ``tied_head`` whether the head is written from the
    embedding's tensor."""

    mode: str
    group_size: int
    symmetric: bool
    lm_head: bool
    linears: frozenset[str]
    tied_head: bool
    # Linears left in the serving dtype: int4 groups must divide their input width.
    not_quantized: tuple[str, ...] = ()
    # Linears in smaller int4 groups than asked, the largest of 64 and 32 that divides.
    smaller_groups: tuple[tuple[str, int], ...] = ()
    head_mode: str | None = None  # the LM head's mode when not ``mode`` (an int8 head)
    # The token embedding's weight name when its table is quantized (``--quantize-embedding``);
    # ``shared`` when a tied head reads that same table.
    embedding: str | None = None
    shared: bool = False

    def mode_of(self, name: str) -> str:
        head = name == "lm_head.weight" or (self.shared and name == self.embedding)
        return self.head_mode if head and self.head_mode else self.mode

    def manifest(
        self,
        kept: dict[str, int] | None = None,
        dequantized: dict[str, int] | None = None,
        kept_groups: tuple[int, ...] = (),
        kept_symmetric: bool = True,
    ) -> Quantization:
        """The manifest's record; ``group_size`` is None unless every quantized linear (a
        GGUF's kept ones included) shares one."""
        groups = set(kept_groups) | {g for _, g in self.smaller_groups}
        if len(self.linears) > len(self.smaller_groups) or self.tied_head:
            groups.add(self.group_size)
        return Quantization(
            mode=self.mode,  # type: ignore[arg-type]
            group_size=groups.pop() if self.mode == "int4" and len(groups) == 1 else None,
            symmetric=(self.symmetric or self.mode == "int8") and kept_symmetric,
            lm_head=self.lm_head,
            lm_head_mode=self.mode_of("lm_head.weight") if self.lm_head else None,
            embedding=self.embedding is not None,
            kept=kept or {},
            dequantized=dequantized or {},
            not_quantized=list(self.not_quantized),
            smaller_groups=dict(self.smaller_groups),
        )

    def tensors(
        self, name: str, tensor: torch.Tensor, dtype: torch.dtype
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """What to write for the checkpoint tensor ``name``: quantized parts for a linear's
        weight, the tensor in ``dtype`` otherwise (and a tied head's parts beside the
        embedding)."""
        if name in self.linears or name == self.embedding:
            yield from _parts(name, self._quantize(tensor, name))
            return
        yield name, tensor.to(dtype=dtype).contiguous()
        if self.tied_head and name.endswith("embed_tokens.weight"):
            yield from _parts("lm_head.weight", self._quantize(tensor, "lm_head.weight"))

    def _quantize(self, tensor: torch.Tensor, name: str) -> QuantizedWeight:
        group = dict(self.smaller_groups).get(name, self.group_size)
        if name == self.embedding and self.mode_of(name) == "int4":
            group = _group_for(tensor.shape[1], self.group_size) or self.group_size
        return quantize(tensor, self.mode_of(name), group, self.symmetric)


def _parts(name: str, weight: QuantizedWeight) -> Iterator[tuple[str, torch.Tensor]]:
    base = name.removesuffix(".weight")
    for part, t in weight.tensors().items():
        yield f"{base}.{part}", t.contiguous()


def plan_quantization(
    skeleton: nn.Module,
    mode: str,
    group_size: int,
    symmetric: bool,
    lm_head: bool,
    tied: bool,
    already: frozenset[str] = frozenset(),
    head_mode: str | None = None,
    embedding: bool = False,
) -> QuantPlan:
    """The linears of ``skeleton`` to quantize (the head only with ``lm_head``), less those
    ``already`` stored quantized (a GGUF's kept tensors); with ``embedding`` the token
    embedding's table too, which a tied head then shares (so the head is quantized with it)."""
    names: set[str] = set()
    skipped: list[str] = []
    smaller: list[tuple[str, int]] = []
    for module_name, module in skeleton.named_modules():
        if not isinstance(module, nn.Linear) or (module_name == "lm_head" and not lm_head):
            continue
        name = f"{module_name}.weight"
        own_mode = head_mode if module_name == "lm_head" and head_mode else mode
        group = _group_for(module.in_features, group_size) if own_mode == "int4" else group_size
        if group is None:
            skipped.append(name)
            continue
        names.add(name)
        if group != group_size and own_mode == "int4":
            smaller.append((name, group))
    table = _token_embedding(skeleton) if embedding else None
    if table is not None and tied:  # the head is the quantized table, stored once
        lm_head = True
    table_mode = (head_mode or mode) if tied else mode
    width = skeleton.get_parameter(table).shape[1] if table is not None else 0
    if table is not None and table_mode == "int4" and _group_for(width, group_size) is None:
        skipped.append(table)
        table = None
    tied_head = lm_head and tied and "lm_head.weight" not in already and table is None
    if tied:  # no head tensor of its own: written from the embedding's (``tied_head``)
        names.discard("lm_head.weight")
    return QuantPlan(
        mode=mode,
        group_size=group_size,
        symmetric=symmetric,
        lm_head=lm_head,
        linears=frozenset(names - already),
        tied_head=tied_head and "lm_head.weight" not in skipped,
        not_quantized=tuple(sorted(set(skipped) - already)),
        smaller_groups=tuple(sorted((n, g) for n, g in smaller if n not in already)),
        head_mode=head_mode if lm_head else None,
        embedding=table,
        shared=table is not None and tied,
    )


def _token_embedding(skeleton: nn.Module) -> str | None:
    """The weight name of the model's token embedding (``embed_tokens``; OPT's position
    embedding is not one)."""
    for module_name, module in skeleton.named_modules():
        if isinstance(module, nn.Embedding) and module_name.endswith("embed_tokens"):
            return f"{module_name}.weight"
    return None


def _group_for(in_features: int, asked: int) -> int | None:
    """The asked int4 group size if it divides ``in_features``, else the largest smaller
    one that does (SmolLM2's 576-wide inputs take 64 when 128 is asked), else None."""
    for group in (asked, 64, 32):
        if group <= asked and in_features % group == 0:
            return group
    return None


def quantized_weight_bytes(skeleton: nn.Module, plan: QuantPlan, dtype: torch.dtype) -> int:
    """Bytes the weights take in memory when served: quantized linears at their codes plus
    scales (and zeros, in ``dtype`` as the kernels hold them), the rest in ``dtype``."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    total = 0
    for name, param in skeleton.named_parameters():
        n = param.numel()
        if name in plan.linears or name == plan.embedding:
            mode = plan.mode_of(name)
            group = dict(plan.smaller_groups).get(name, plan.group_size)
            if name == plan.embedding:
                group = _group_for(param.shape[1], plan.group_size) or plan.group_size
            groups = 1 if mode == "int8" else param.shape[1] // group
            code_bytes = n if mode == "int8" else n // 2
            extra = 1 if mode == "int8" or plan.symmetric else 2
            total += code_bytes + param.shape[0] * groups * extra * itemsize
        else:
            total += n * itemsize
    return total


def gguf_keep_types(mode: str | None) -> frozenset[str]:
    """The GGUF tensor types kept quantized for ``--quantization mode``: none without it, the
    ones of the asked width for int8/int4, all that can be kept for keep."""
    from quanta.build.gguf_kept import KEEPABLE

    if mode is None:
        return frozenset()
    if mode == "keep":
        return frozenset(KEEPABLE)
    return frozenset(t for t, kept_mode in KEEPABLE.items() if kept_mode == mode)


def gguf_keeps_table(options: BuildOptions) -> bool:
    """Whether a GGUF's quantized token embedding is kept as the file holds it: whenever the
    build quantizes, unless ``--quantize-embedding`` or ``--quantize-lm-head`` asks the table
    (or a tied head, written from it) quantized anew."""
    return options.quantization is not None and not (
        options.quantize_embedding or options.quantize_lm_head
    )


def quant_plan(
    options: BuildOptions, config: ModelConfig, prequantized: frozenset[str], checkpoint: Path
) -> QuantPlan | None:
    """What the build quantizes: every linear not stored quantized already (``prequantized``,
    a GGUF's kept weights) for int8 and int4, or nothing more than the GGUF kept (keep, or no
    ``--quantization`` on a kept GGUF)."""
    from quanta.build.steps import BuildError
    from quanta.runner.models import build_model_skeleton

    mode = options.quantization
    if options.quantize_embedding and mode not in ("int8", "int4"):
        raise BuildError(
            "--quantize-embedding quantizes the table in the layers' mode: it needs "
            "--quantization int8 or int4"
        )
    if mode == "keep" and not prequantized:
        raise BuildError(
            f"{checkpoint}: --quantization keep needs a GGUF file with Q8_0, Q4_0 or Q4_1 "
            "tensors; use int8 or int4 to quantize a float checkpoint"
        )
    if mode is None and not prequantized:
        return None
    if mode in (None, "keep"):
        return QuantPlan("keep", 0, True, False, frozenset(), False)
    return plan_quantization(
        build_model_skeleton(config),
        mode,
        options.group_size,
        options.symmetric,
        options.quantize_lm_head,
        tied=config.tie_word_embeddings,
        already=prequantized,
        head_mode=options.lm_head_quantization,
        embedding=options.quantize_embedding,
    )


def quant_manifest(
    quant: QuantPlan | None, prequantized: frozenset[str], kept: GgufKept | None
) -> Quantization | None:
    """The manifest's ``quantization`` record of what the build stored."""
    if quant is None:
        return None
    kept_types = kept.kept if kept else {}
    dequantized = kept.dequantized if kept else {}
    if quant.mode != "keep":
        groups = tuple(kept.groups) if kept else ()
        return quant.manifest(kept_types, dequantized, groups, kept.symmetric if kept else True)
    assert kept is not None, "keep needs a GGUF's kept tensors"
    modes, groups = set(kept.modes), set(kept.groups)
    return Quantization(
        mode=modes.pop() if len(modes) == 1 else "mixed",  # type: ignore[arg-type]
        group_size=groups.pop() if len(groups) == 1 else None,
        symmetric=kept.symmetric,
        lm_head="lm_head.weight" in prequantized,
        kept=kept_types,
        dequantized=dequantized,
    )


def write_dequantized(engine: Path, out: Path) -> Path:
    """A float32 checkpoint of ``engine`` holding its quantized values dequantized: the
    reference the parity tests and ``quanta bench quality`` compare a quantized engine with
    (same values, float kernels). A quantized tied head becomes an untied head of its own."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from quanta.runner.models.loader import checkpoint_files

    engine, out = Path(engine), Path(out)
    out.mkdir(parents=True, exist_ok=False)
    floats: dict[str, torch.Tensor] = {}
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for path in checkpoint_files(engine):
        with safe_open(str(path), framework="pt", device="cpu") as reader:
            for key in reader.keys():  # noqa: SIM118 - safe_open is not a mapping
                base, _, part = key.rpartition(".")
                if "." + part in QUANT_SUFFIXES:
                    parts.setdefault(base, {})[part] = reader.get_tensor(key)
                else:
                    floats[key] = reader.get_tensor(key).float()
    for base, tensors in parts.items():
        floats[f"{base}.weight"] = QuantizedWeight.from_tensors(tensors).dequantize()
    save_file(floats, str(out / "model.safetensors"), metadata={"format": "pt"})
    for side in engine.iterdir():
        if side.is_file() and side.suffix == ".json" and side.name != MANIFEST_FILE:
            shutil.copy2(side, out / side.name)
    config = json.loads((out / "config.json").read_text(encoding="utf-8"))
    config["torch_dtype"] = "float32"
    if "lm_head.weight" in floats:
        config["tie_word_embeddings"] = False
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return out
