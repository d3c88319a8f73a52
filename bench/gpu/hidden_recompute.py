"""What recomputing K and V from cached hidden states costs a decode step on a real device.

Apt-Serve's hidden cache keeps each layer's input instead of its K and V, and projects them
again every step. Whether that is cheap depends on the device: a small decode batch leaves
its GEMMs bound by reading the weights, and extra rows may ride under that bound. This
benchmark times, per transformer layer of an OPT-style model (``hidden`` d, MLP 4d), with
torch's own GEMMs:

- ``dense``: the step's four weight products for ``b`` new tokens (QKV, out, FC1, FC2);
- ``qkv``: the QKV product alone for ``b`` tokens;
- ``fused``: the QKV product over ``b`` new rows plus ``h`` hidden rows (one kernel, the
  weights read once; the hidden rows' Q is computed and dropped);
- ``split``: the QKV product for ``b`` rows, then a K/V product for the ``h`` hidden rows.

It prints, for each batch, the extra step time of ``h`` hidden tokens over all layers, and
the cost per hidden token from the two largest ``h``. It needs only torch, so it runs on any
machine with a GPU (``--device cuda``, the default where one is seen) and, at tiny sizes, on
the CPU (the smoke test). Usage: ``python bench/gpu/hidden_recompute.py --output out.json``.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from collections.abc import Callable

import torch


def _timer(device: torch.device) -> Callable[[Callable[[], object], int], float]:
    """Seconds per call of ``fn``, the median of 5 trials of ``repeats`` calls each."""

    def run(fn: Callable[[], object], repeats: int) -> float:
        for _ in range(3):
            fn()
        trials = []
        for _ in range(5):
            if device.type == "cuda":
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(repeats):
                    fn()
                end.record()
                end.synchronize()
                trials.append(start.elapsed_time(end) / 1e3 / repeats)
            else:
                t0 = time.perf_counter()
                for _ in range(repeats):
                    fn()
                trials.append((time.perf_counter() - t0) / repeats)
        return statistics.median(trials)

    return run


def _dense(x: torch.Tensor, x4: torch.Tensor, w: tuple[torch.Tensor, ...]) -> None:
    """One layer's four weight products for the rows of ``x`` (``x4``: the FC2 input)."""
    w_qkv, w_out, w_fc1, w_fc2 = w
    x @ w_qkv
    x @ w_out
    x @ w_fc1
    x4 @ w_fc2


def _split(x: torch.Tensor, xh: torch.Tensor, w_qkv: torch.Tensor, w_kv: torch.Tensor) -> None:
    x @ w_qkv
    xh @ w_kv


def measure(
    hidden: int,
    layers: int,
    batches: list[int],
    hidden_tokens: list[int],
    device: torch.device,
    dtype: torch.dtype,
    repeats: int,
) -> dict[str, object]:
    d = hidden
    g = torch.Generator(device="cpu").manual_seed(0)

    def weight(rows: int, cols: int) -> torch.Tensor:
        return (torch.randn(rows, cols, generator=g) / rows**0.5).to(device, dtype)

    w_qkv, w_kv, w_out = weight(d, 3 * d), weight(d, 2 * d), weight(d, d)
    w_fc1, w_fc2 = weight(d, 4 * d), weight(4 * d, d)
    top = max(batches) + max(hidden_tokens)
    rows = (torch.randn(top, 4 * d, generator=g) / 10).to(device, dtype)
    x4 = rows  # an FC2 input
    x = rows[:, :d].contiguous()
    time_of = _timer(device)
    out: dict[str, object] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": str(dtype).removeprefix("torch."),
        "hidden": d,
        "layers": layers,
        "batches": {},
    }
    for b in batches:
        xb, x4b = x[:b], x4[:b]
        dense = functools.partial(_dense, xb, x4b, (w_qkv, w_out, w_fc1, w_fc2))
        qkv = time_of(functools.partial(torch.matmul, xb, w_qkv), repeats)
        row: dict[str, object] = {
            "dense_step_s": time_of(dense, repeats) * layers,
            "qkv_step_s": qkv * layers,
            "extra_step_s": {},
        }
        for h in hidden_tokens:
            if h == 0:
                continue
            fused = time_of(functools.partial(torch.matmul, x[: b + h], w_qkv), repeats)
            split = time_of(functools.partial(_split, xb, x[b : b + h], w_qkv, w_kv), repeats)
            row["extra_step_s"][h] = {  # type: ignore[index]
                "fused": (fused - qkv) * layers,
                "split": (split - qkv) * layers,
            }
        extra = row["extra_step_s"]
        big = sorted(extra)[-2:]  # type: ignore[arg-type]
        if len(big) == 2:
            lo, hi = big
            row["per_hidden_token_s"] = {
                k: (extra[hi][k] - extra[lo][k]) / (hi - lo)  # type: ignore[index]
                for k in ("fused", "split")
            }
        out["batches"][b] = row  # type: ignore[index]
    return out


def report(result: dict[str, object]) -> str:
    lines = [
        f"device {result['device']}, {result['dtype']}, hidden {result['hidden']}, "
        f"{result['layers']} layers; times are per decode step, all layers"
    ]
    for b, row in result["batches"].items():  # type: ignore[union-attr]
        lines.append(
            f"batch {b}: dense GEMMs {row['dense_step_s'] * 1e3:.2f} ms "
            f"(QKV {row['qkv_step_s'] * 1e3:.2f} ms)"
        )
        for h, e in row["extra_step_s"].items():
            lines.append(
                f"  + {h:5d} hidden tokens: fused +{e['fused'] * 1e3:7.3f} ms, "
                f"split +{e['split'] * 1e3:7.3f} ms"
            )
        if "per_hidden_token_s" in row:
            p = row["per_hidden_token_s"]
            lines.append(
                f"  per hidden token: fused {p['fused'] * 1e6:.2f} us, "
                f"split {p['split'] * 1e6:.2f} us"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=5120, help="d (OPT-13B: 5120)")
    parser.add_argument("--layers", type=int, default=40, help="layers (OPT-13B: 40)")
    parser.add_argument("--batches", default="16,60,100")
    parser.add_argument("--hidden-tokens", default="64,128,256,512,1024,2048,4096")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--output", default=None, help="write the figures as JSON")
    a = parser.parse_args()
    result = measure(
        a.hidden,
        a.layers,
        [int(v) for v in a.batches.split(",")],
        [int(v) for v in a.hidden_tokens.split(",")],
        torch.device(a.device),
        getattr(torch, a.dtype),
        a.repeats,
    )
    print(report(result))
    if a.output:
        with open(a.output, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
