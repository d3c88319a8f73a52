"""The lm-evaluation-harness benchmark without lm_eval: the project's task data and the report
that sets Quanta's scores beside HF's (bench/lm_eval/compare.py, on outputs shaped as lm_eval
0.4 writes them). The run itself (bench/lm_eval/run.sh) installs lm_eval from the network and is
run by hand; docs/results/benchmarks.md has its numbers."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench" / "lm_eval"


def load_compare() -> ModuleType:
    spec = importlib.util.spec_from_file_location("lm_eval_compare", BENCH / "compare.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_task_data_is_well_formed():
    docs = [json.loads(line) for line in (BENCH / "data" / "facts.jsonl").read_text().splitlines()]
    assert 30 <= len(docs) <= 50
    assert len({d["question"] for d in docs}) == len(docs)
    for d in docs:
        assert len(d["choices"]) == 4 == len(set(d["choices"]))
        assert d["choices"][d["answer"]] == d["target"]
    # the right answer moves, so one fixed slot scores chance (25%)
    assert {d["answer"] for d in docs} == {0, 1, 2, 3}
    for name in ("quanta_facts_mc.yaml", "quanta_facts_gen.yaml"):
        assert "bench/lm_eval/data/facts.jsonl" in (BENCH / "tasks" / name).read_text()


def write_run(root: Path, stamp: str, acc: float, lls: list[list[float]], texts: list[str]):
    """One lm_eval output directory: results JSON and per-task samples, nested as lm_eval
    nests them (under a folder named after the model)."""
    out = root / "model"
    out.mkdir(parents=True, exist_ok=True)
    results = {
        "results": {
            "quanta_facts_mc": {
                "alias": "quanta_facts_mc",
                "acc,none": acc,
                "acc_stderr,none": 0.1,
            },
            "quanta_facts_gen": {"exact_match,strip": 0.5, "sample_len": len(texts)},
        }
    }
    (out / f"results_{stamp}.json").write_text(json.dumps(results))
    mc = [{"doc_id": i, "resps": [[[str(v), "False"]] for v in doc]} for i, doc in enumerate(lls)]
    gen = [
        {"doc_id": i, "resps": [[text]], "filtered_resps": [text.strip()]}
        for i, text in enumerate(texts)
    ]
    for task, rows in (("quanta_facts_mc", mc), ("quanta_facts_gen", gen)):
        lines = "\n".join(json.dumps(r) for r in rows)
        (out / f"samples_{task}_{stamp}.jsonl").write_text(lines + "\n")


def test_report_sets_the_scores_side_by_side_and_counts_disagreements(tmp_path):
    compare = load_compare()
    # an older run in the same folder is ignored: the newest stamp wins
    write_run(tmp_path / "q", "2026-01-01T00-00-00.0", 0.0, [[-9.0, -1.0]], ["x"])
    write_run(tmp_path / "q", "2026-11-24T18-00-00.0", 0.5, [[-1.0, -2.0], [-3.0, -2.5]],
              [" Paris", " 7"])  # fmt: skip
    write_run(tmp_path / "h", "2026-11-24T18-05-00.0", 1.0, [[-1.00001, -2.0], [-2.0, -2.5]],
              [" Paris", " 8"])  # fmt: skip
    text = compare.report(tmp_path / "q", tmp_path / "h")
    assert "| quanta_facts_mc | acc | 0.5000 | 1.0000 |" in text
    assert "| quanta_facts_gen | exact_match | 0.5000 | 0.5000 |" in text
    assert "stderr" not in text and "sample_len" not in text
    assert "quanta_facts_mc: 2 documents, 1 decided differently" in text
    assert "largest log-likelihood difference 1.00e+00" in text
    assert "quanta_facts_gen: 2 documents, 1 decided differently" in text


def test_report_labels_its_columns_when_told(tmp_path, capsys):
    """Two runs of the gateway (batch sizes 1 and 4, bench/clients/run.sh) side by side."""
    compare = load_compare()
    for name in ("b1", "b4"):
        write_run(tmp_path / name, "2026-11-27T23-00-00.0", 0.5, [[-1.0, -2.0]], [" Paris"])
    compare.main([str(tmp_path / "b1"), str(tmp_path / "b4"), "batch 1", "batch 4"])
    text = capsys.readouterr().out
    assert "| task | metric | batch 1 | batch 4 |" in text
    assert "quanta_facts_mc: 1 documents, 0 decided differently" in text
