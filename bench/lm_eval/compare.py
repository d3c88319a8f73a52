"""Side by side: lm-evaluation-harness scores of Quanta (through its OpenAI gateway) and of HF.

Why a script of its own: lm_eval writes one results JSON per run, with per-sample logs
(``--log_samples``); the question this benchmark answers is whether the two backends agree,
so besides each task's metrics it counts the documents on which they decided differently
(another choice picked, another generated answer) and the largest difference in a choice's
log-likelihood. Standard library only: it runs with the lm_eval venv's interpreter or any other.

    python bench/lm_eval/compare.py out/lm_eval/quanta out/lm_eval/hf
    python bench/lm_eval/compare.py out/clients/lmeval-b1 out/clients/lmeval-b4 "batch 1" "batch 4"
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def latest(root: Path, pattern: str) -> list[Path]:
    """The files of the newest run under ``root`` (lm_eval nests them under the model's name
    and stamps each with the time: the newest stamp wins)."""
    found = sorted(root.rglob(pattern), key=lambda p: p.name)
    if not found:
        raise SystemExit(f"no {pattern} under {root}: did lm_eval run with --output_path there?")
    stamp = found[-1].stem.rsplit("_", 1)[-1]
    return [p for p in found if p.stem.endswith(stamp)]


def results(root: Path) -> dict[str, dict[str, float]]:
    """Task -> metric (``acc,none`` as lm_eval names it) -> value."""
    data = json.loads(latest(root, "results_*.json")[0].read_text(encoding="utf-8"))
    return {
        task: {k: v for k, v in metrics.items() if isinstance(v, int | float) and k != "alias"}
        for task, metrics in data["results"].items()
    }


def samples(root: Path) -> dict[str, dict[int, dict[str, Any]]]:
    """Task -> document id -> its logged sample."""
    out: dict[str, dict[int, dict[str, Any]]] = {}
    for path in latest(root, "samples_*.jsonl"):
        task = path.stem.removeprefix("samples_").rsplit("_", 1)[0]
        lines = path.read_text(encoding="utf-8").splitlines()
        out[task] = {(s := json.loads(line))["doc_id"]: s for line in lines if line.strip()}
    return out


def disagreements(a: dict[str, Any], b: dict[str, Any]) -> tuple[bool, float]:
    """Whether two samples of one document decided differently, and the largest difference
    between their choices' log-likelihoods (0 for generation)."""
    # NOTE: lm_eval logs responses as strings: [["-4.5", "False"]] per choice in multiple
    # choice (log-likelihood, is_greedy), ["text"] per generation
    if isinstance(a["resps"][0][0], list):
        lls_a = [float(r[0][0]) for r in a["resps"]]
        lls_b = [float(r[0][0]) for r in b["resps"]]
        gap = max(abs(x - y) for x, y in zip(lls_a, lls_b, strict=True))
        picked = lls_a.index(max(lls_a)) != lls_b.index(max(lls_b))
        return picked, gap
    return a["filtered_resps"] != b["filtered_resps"], 0.0


def report(
    quanta: Path, hf: Path, labels: tuple[str, str] = ("Quanta (gateway)", "HF transformers")
) -> str:
    """The table: one row per task and metric, then how far the two runs agree per task.
    ``labels`` head the two columns (bench/clients/run.sh sets two batch sizes side by side)."""
    ours, theirs = results(quanta), results(hf)
    rows = [f"| task | metric | {labels[0]} | {labels[1]} |", "|---|---|---|---|"]
    for task in sorted(ours):
        for metric, value in sorted(ours[task].items()):
            if "_stderr" in metric or metric.startswith("sample_len"):
                continue
            other = theirs.get(task, {}).get(metric)
            shown = "-" if other is None else f"{other:.4f}"
            rows.append(f"| {task} | {metric.split(',')[0]} | {value:.4f} | {shown} |")
    lines = ["\n".join(rows), ""]
    ours_s, theirs_s = samples(quanta), samples(hf)
    for task in sorted(ours_s):
        pairs = [(s, theirs_s.get(task, {}).get(doc)) for doc, s in ours_s[task].items()]
        compared = [disagreements(a, b) for a, b in pairs if b is not None]
        differ = sum(d for d, _ in compared)
        gap = max((g for _, g in compared), default=0.0)
        lines.append(
            f"{task}: {len(compared)} documents, {differ} decided differently"
            + (f", largest log-likelihood difference {gap:.2e}" if gap else "")
        )
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    if len(argv) not in (2, 4):
        raise SystemExit("usage: compare.py QUANTA_OUTPUT_DIR HF_OUTPUT_DIR [LABEL LABEL]")
    labels = (argv[2], argv[3]) if len(argv) == 4 else None
    print(report(Path(argv[0]), Path(argv[1]), *([labels] if labels else [])))


if __name__ == "__main__":
    main(sys.argv[1:])
