"""Fill a meta-built model from safetensors, one tensor at a time.

Each checkpoint tensor is read with ``safe_open``, converted to the target dtype and device
and installed as the parameter, so the process never holds two full copies of the weights.
Our modules keep HF's parameter names; the only mapping is re-adding a prefix that some
exports drop (``decoder.`` for OPT, no ``model.`` at all for either family).
"""

from __future__ import annotations

import json
from collections.abc import Collection
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from quanta.runner.quantized import QUANT_SUFFIXES, QuantizedWeight

_PREFIXES: tuple[str, ...] = ("", "model.", "model.decoder.")


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint: one file, an index and its shards, or all."""
    model_dir = Path(model_dir)
    single = model_dir / "model.safetensors"
    index = model_dir / "model.safetensors.index.json"
    if single.is_file():
        return [single]
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        shards = [model_dir / name for name in sorted(set(weight_map.values()))]
        absent = [str(p) for p in shards if not p.is_file()]
        if absent:
            raise FileNotFoundError(f"shards named in {index.name} are missing: {absent[:5]}")
        return shards
    found = sorted(model_dir.glob("*.safetensors"))
    if not found:
        raise FileNotFoundError(
            f"no safetensors weights in {model_dir} (pytorch_model.bin is not supported)"
        )
    return found


def resolve_name(key: str, names: Collection[str]) -> str | None:
    """Our parameter name for a checkpoint key, trying the prefixes exports drop."""
    for prefix in _PREFIXES:
        if prefix + key in names:
            return prefix + key
    return None


def load_weights(
    model: nn.Module, model_dir: str | Path, *, dtype: torch.dtype, device: torch.device
) -> None:
    """Load every parameter of ``model`` from ``model_dir``; missing or unexpected names raise.

    ``model`` may be built on the meta device; tied parameters are re-tied afterwards through
    ``model.tie_weights()``.  Rejects shape mismatches before installing anything wrong.
    """
    params = dict(model.named_parameters())  # a tied head appears once, under the embedding
    loaded: set[str] = set()
    unexpected: list[str] = []
    quantized: dict[str, dict[str, torch.Tensor]] = {}  # linear's weight name -> its parts
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as reader:
            for key in reader.keys():  # noqa: SIM118 - safe_open is not a mapping
                base, dot, part = key.rpartition(".")
                if dot and "." + part in QUANT_SUFFIXES:
                    name = resolve_name(base + ".weight", _with_head(model, params))
                    if name is None:
                        unexpected.append(key)
                    else:
                        quantized.setdefault(name, {})[part] = reader.get_tensor(key)
                    continue
                name = resolve_name(key, params)
                if name is None:
                    if not _ignorable(model, key):
                        unexpected.append(key)
                    continue
                if name in loaded:
                    raise ValueError(f"checkpoint holds {name!r} twice (as {key!r})")
                tensor = reader.get_tensor(key)
                expected = tuple(params[name].shape)
                if tuple(tensor.shape) != expected:
                    raise ValueError(
                        f"weight {key!r} has shape {tuple(tensor.shape)}, model expects {expected}"
                    )
                _set_parameter(model, name, tensor.to(device=device, dtype=dtype))
                loaded.add(name)
    for name, parts in quantized.items():
        _set_quantized(model, name, parts, dtype=dtype, device=device)
        loaded.add(name)
    missing = sorted(set(params) - loaded)
    if missing or unexpected:
        raise ValueError(
            f"checkpoint in {model_dir} does not match the model: "
            f"{len(missing)} missing (e.g. {missing[:5]}), "
            f"{len(unexpected)} unexpected (e.g. {unexpected[:5]})"
        )
    model.tie_weights()  # type: ignore[operator]
    _share_quantized_table(model, dtype)


def _share_quantized_table(model: nn.Module, dtype: torch.dtype) -> None:
    """A tied head whose embedding's table is stored quantized (``--quantize-embedding``, a
    GGUF's kept ``token_embd``) is that same quantized table, except a grouped int8 one
    (GGUF Q8_0): no kernel reads that faster than dequantizing the whole table every step,
    so the head holds it dequantized to ``dtype`` once, as a float engine's head is (the file
    stays small; memory holds the codes for the lookup and the float head)."""
    head = getattr(model, "lm_head", None)
    if not isinstance(head, nn.Linear) or hasattr(head, "quantized"):
        return
    for module in model.modules():
        table = getattr(module, "quantized", None)
        if isinstance(module, nn.Embedding) and table is not None and module.weight is head.weight:
            if table.mode == "int8" and table.group_size != table.in_features:
                head.weight = nn.Parameter(table.dequantize(dtype), requires_grad=False)
            else:
                head.quantized = table  # type: ignore[assignment]


def _with_head(model: nn.Module, params: dict[str, nn.Parameter]) -> set[str]:
    """Parameter names plus a tied head's own (a quantized head is stored under its name,
    apart from the embedding it is tied to)."""
    names = set(params)
    if hasattr(model, "lm_head"):
        names.add("lm_head.weight")
    return names


def _set_quantized(
    model: nn.Module,
    name: str,
    parts: dict[str, torch.Tensor],
    *,
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    """Hang the quantized weight on its ``nn.Linear`` (``quanta.runner.quantized``), where
    ``fuse`` finds it; the float weight stays an empty meta tensor of the serving dtype, so the
    product knows its activation dtype and nothing is allocated for it."""
    if "qweight" not in parts or "scales" not in parts:
        raise ValueError(f"quantized weight {name!r} lacks its qweight or scales")
    owner_name, _, attr = name.rpartition(".")
    owner = model.get_submodule(owner_name)
    if not isinstance(owner, nn.Linear | nn.Embedding) or attr != "weight":
        raise ValueError(
            f"{name!r} is quantized, but only linear layers' and embeddings' weights can be"
        )
    weight = QuantizedWeight.from_tensors({k: v.to(device) for k, v in parts.items()})
    expected = tuple(owner.weight.shape)
    if (weight.out_features, weight.in_features) != expected:
        raise ValueError(
            f"quantized {name!r} is {weight.out_features}x{weight.in_features}, the model "
            f"expects {expected[0]}x{expected[1]}"
        )
    owner.quantized = weight  # type: ignore[assignment]
    # A tied head becomes its own (quantized) module: untie it from the embedding.
    owner._parameters["weight"] = nn.Parameter(
        torch.empty(expected, dtype=dtype, device="meta"), requires_grad=False
    )


def _ignorable(model: nn.Module, key: str) -> bool:
    check = getattr(model, "is_ignorable_weight", None)
    if check is None:
        return False
    return any(check(prefix + key) for prefix in _PREFIXES)


def _set_parameter(model: nn.Module, name: str, value: torch.Tensor) -> None:
    owner_name, _, attr = name.rpartition(".")
    owner = model.get_submodule(owner_name) if owner_name else model
    owner._parameters[attr] = nn.Parameter(value, requires_grad=False)
