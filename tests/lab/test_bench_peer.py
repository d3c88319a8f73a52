"""The vLLM comparison harness without vLLM: workloads, server commands, priorities, the
full-vocabulary tokenizer, the server process lifecycle and the report."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
from quanta.bench.client import to_client_requests
from quanta.metrics import SLO
from quanta.workloads import WorkloadRequest
from quanta_lab.bench.peer import (
    VLLM_PRIORITIES,
    PeerSetup,
    QuantaServer,
    Server,
    VllmServer,
    full_vocab_checkpoint,
    kv_bytes_per_block,
    make_server,
    prometheus_total,
    render_markdown,
    request_priority,
    side_by_side,
    workload_for,
)


@pytest.fixture(scope="module")
def model_dir(opt_tiny) -> Path:
    return opt_tiny


def setup_for(model_dir: Path, tmp_path: Path, **changes) -> PeerSetup:
    return PeerSetup(
        model_dir=model_dir, vllm_python=Path(sys.executable), out_dir=tmp_path, **changes
    )


def test_every_rate_gets_the_same_requests_scaled_in_time(model_dir, tmp_path):
    setup = setup_for(model_dir, tmp_path, num_requests=30, prompt_tokens=(8, 16))
    slow, fast = workload_for(setup, 1.0), workload_for(setup, 4.0)
    assert [(r.prompt_tokens, r.output_tokens) for r in slow] == [
        (r.prompt_tokens, r.output_tokens) for r in fast
    ]
    assert [r.arrival_time / 4 for r in slow] == pytest.approx([r.arrival_time for r in fast])
    assert all(8 <= r.prompt_tokens <= 16 for r in slow)
    assert workload_for(setup, 1.0) == slow  # seeded


def test_only_vllms_priority_policy_is_sent_priorities(model_dir, tmp_path):
    setup = setup_for(model_dir, tmp_path)
    priority = make_server(setup, "vllm-priority")
    assert isinstance(priority, VllmServer)
    assert request_priority(make_server(setup, "vllm-fcfs")) is None
    assert request_priority(make_server(setup, "quanta-sj-mlfq")) is None
    rows = [
        WorkloadRequest(0.0, 90, 5, "long"),
        WorkloadRequest(0.0, 10, 5, "short", priority_class="offline"),
    ]
    sent = to_client_requests(rows, priority=request_priority(priority))
    assert [r.priority for r in sent] == [90, 10]  # prompt-length: shortest prompt first
    by_class = make_server(setup_for(model_dir, tmp_path, vllm_priority="class"), "vllm-priority")
    assert [r.priority for r in to_client_requests(rows, priority=request_priority(by_class))] == [
        0,
        1,
    ]
    none = make_server(setup_for(model_dir, tmp_path, vllm_priority="none"), "vllm-priority")
    assert request_priority(none) is None
    assert set(VLLM_PRIORITIES) == {"prompt-length", "class", "none"}


def test_both_servers_get_the_same_limits(model_dir, tmp_path):
    setup = setup_for(model_dir, tmp_path, kv_cache_bytes=1 << 26, max_num_seqs=7, threads=1)
    vllm = make_server(setup, "vllm-priority")
    cmd = vllm.command()

    def flag(name: str) -> str:
        return cmd[cmd.index(name) + 1]

    assert flag("--scheduling-policy") == "priority"
    assert flag("--kv-cache-memory-bytes") == str(1 << 26)
    assert flag("--max-num-seqs") == "7"
    assert flag("--host") == "127.0.0.1" and int(flag("--port")) == vllm.port
    assert "--enable-prefix-caching" in cmd and flag("--block-size") == "32"
    assert vllm.env()["OMP_NUM_THREADS"] == "1"
    off = setup_for(model_dir, tmp_path, prefix_caching=False)
    assert "--no-enable-prefix-caching" in make_server(off, "vllm-fcfs").command()

    quanta = make_server(setup, "quanta-sj-mlfq")
    assert isinstance(quanta, QuantaServer)
    params = quanta.parameters()
    cfg = json.loads((model_dir / "config.json").read_text())
    per_block = 2 * cfg["num_hidden_layers"] * cfg["hidden_size"] * 4 * 16
    assert kv_bytes_per_block(model_dir) == per_block
    assert params["num_device_blocks"] == str((1 << 26) // (2 * per_block))  # 32-token blocks
    assert params["policy"] == "sj-mlfq" and params["max_num_seqs"] == "7"
    assert params["enable_prefix_caching"] == "true"  # as vLLM's, above
    assert params["block_size"] == "32"
    no_cache = make_server(off, "quanta-fcfs")
    assert no_cache.parameters()["enable_prefix_caching"] == "false"
    no_cache.stop()
    assert "policy_options" not in params
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({"name": "fitted"}))
    with_profile = make_server(setup_for(model_dir, tmp_path, sj_profile=profile), "quanta-sj-mlfq")
    options = json.loads(with_profile.parameters()["policy_options"])
    assert options == {"profile": {"name": "fitted"}}
    quanta.stop()
    with_profile.stop()
    with pytest.raises(ValueError, match="unknown system"):
        make_server(setup, "tgi-fcfs")


def test_kv_bytes_per_block_counts_the_kv_heads_only(tmp_path):
    """A grouped-query model keeps K and V for its KV heads: both servers are sized alike."""
    cfg = {"num_hidden_layers": 30, "hidden_size": 576, "num_attention_heads": 9}
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "num_key_value_heads": 3}))
    assert kv_bytes_per_block(tmp_path, 16, 2) == 2 * 30 * 3 * 64 * 2 * 16
    (tmp_path / "config.json").write_text(json.dumps(cfg))  # multi-head
    assert kv_bytes_per_block(tmp_path, 16, 2) == 2 * 30 * 576 * 2 * 16


def test_prefix_cache_counters_are_summed_over_labels_from_the_metrics():
    text = (
        "# HELP vllm:prefix_cache_hits_total Prefix cache hits\n"
        'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 96.0\n'
        'vllm:prefix_cache_hits_total{engine="1",model_name="m"} 4.0\n'
        "vllm:prefix_cache_hits_created 1.7e9\n"
        "quanta_prefix_cache_queries_total 320\n"
    )
    assert prometheus_total(text, "vllm:prefix_cache_hits_total") == 100.0
    assert prometheus_total(text, "quanta_prefix_cache_queries_total") == 320.0
    assert prometheus_total(text, "vllm:prefix_cache_queries_total") is None


def test_a_workload_file_is_replayed_at_every_rate_with_its_shared_prefixes(model_dir, tmp_path):
    from quanta.workloads import chat, save_workload

    path = save_workload(tmp_path / "chat.jsonl", chat(24, 1.0, seed=3, max_len=512))
    setup = setup_for(model_dir, tmp_path, workload=path, num_requests=20)
    slow, fast = workload_for(setup, 0.5), workload_for(setup, 2.0)
    assert len(slow) == 20 and [r.request_id for r in slow] == [r.request_id for r in fast]
    assert [r.prefix_group for r in slow] == [r.prefix_group for r in fast]
    assert all(r.prefix_group for r in slow) and slow[-1].arrival_time > fast[-1].arrival_time
    turns = [r for r in slow if r.interaction_stage]
    assert turns and all(r.think_time_s > 0 for r in turns)


def test_full_vocab_tokenizer_names_every_id(model_dir, tmp_path):
    """Like the opt-125m preset: an embedding with more rows than the tokenizer names."""
    import shutil

    from tokenizers import Tokenizer

    small = tmp_path / "small"
    shutil.copytree(model_dir, small)
    config = json.loads((small / "config.json").read_text())
    known = Tokenizer.from_file(str(small / "tokenizer.json")).get_vocab_size(True)
    vocab = config["vocab_size"] = known + 40
    (small / "config.json").write_text(json.dumps(config))
    full = full_vocab_checkpoint(small, tmp_path / "full")
    tok = Tokenizer.from_file(str(full / "tokenizer.json"))
    assert tok.get_vocab_size(with_added_tokens=True) == vocab
    assert tok.decode([vocab - 1]).strip() == f"x{vocab - 1}"
    assert (
        tok.encode("hello").ids
        == Tokenizer.from_file(str(small / "tokenizer.json")).encode("hello").ids
    )  # the known ids are untouched
    assert (full / "model.safetensors").resolve() == (small / "model.safetensors").resolve()
    assert full_vocab_checkpoint(full, tmp_path / "again") == full  # already full: as is
    assert full_vocab_checkpoint(model_dir, tmp_path / "tiny") == model_dir


_FAKE_SERVER = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/v1/models" else 404)
        self.end_headers()
        self.wfile.write(b"{}")
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


class _Fake(Server):
    name = "fake"

    def __init__(self, port: int, log: Path, code: str) -> None:
        super().__init__(port, log)
        self.code = code

    def command(self) -> list[str]:
        return [sys.executable, "-c", self.code, str(self.port)]


def test_server_process_is_started_polled_and_stopped(tmp_path):
    from quanta_lab.bench.peer import free_port

    server = _Fake(free_port(), tmp_path / "logs" / "fake.log", _FAKE_SERVER)
    server.start()
    try:
        assert server.wait_ready(30) >= 0
        proc = server._proc
    finally:
        server.stop(timeout=10)
    assert proc is not None and proc.poll() is not None  # gone, not orphaned
    dying = _Fake(free_port(), tmp_path / "logs" / "dying.log", "print('no model here'); exit(3)")
    dying.start()
    with pytest.raises(RuntimeError, match=r"(?s)exited early.*no model here"):
        dying.wait_ready(30)
    dying.stop()


def _summary(rate: float, attainment: float) -> dict:
    stats = {"mean": 0.5 / rate, "p50": 0.4, "p95": 0.9, "p99": 1.0}
    return {
        "num_requests": 40,
        "num_finished": 40,
        "ttft_s": stats,
        "tpot_s": stats,
        "normalized_latency_s": stats,
        "request_throughput": rate,
        "output_token_throughput": 40 * rate,
        "goodput_rps": rate * attainment,
        "slo_attainment": attainment,
    }


def test_side_by_side_table_and_max_rate(model_dir, tmp_path):
    setup = setup_for(model_dir, tmp_path, slo=SLO(ttft_s=2.0, tpot_s=0.3, tbt_s=1.0))
    runs = [(0.5, 1.0), (1.0, 0.95), (2.0, 0.5)]
    report = {
        "setup": {"slo": {"ttft_s": 2.0, "tpot_s": 0.3, "tbt_s": 1.0}, "slo_goal": 0.9},
        "systems": [
            {
                "system": "quanta-fcfs",
                "runs": [
                    {
                        "rate": r,
                        "summary": _summary(r, a),
                        "loadavg_before": (1.5, 1, 1),
                        "prefix_cache": {"queries": 800, "hits": 300, "hit_rate": 0.375},
                    }
                    for r, a in runs
                ],
            }
        ],
    }
    report["table"] = side_by_side(report, setup)
    assert [row["rate"] for row in report["table"]] == [0.5, 1.0, 2.0]
    row = report["table"][1]
    assert row["max_rate"] == 1.0
    assert math.isclose(row["max_rate_interp"], 1.0 + (0.95 - 0.9) / (0.95 - 0.5))
    assert row["ttft_mean"] == 0.5 and row["attainment"] == 0.95
    markdown = render_markdown(report)
    assert "| quanta-fcfs | 1 | 40/40 | 500 | 400 | 900 |" in markdown  # TTFT mean, p50, p95
    assert "| prefix hit rate |" in markdown and "| 37.5% | 1.5 |" in markdown
    assert "| 1 (1.11) |" in markdown
    assert "TTFT <= 2000 ms" in markdown


@pytest.mark.engine
def test_engine_figures_take_each_peer_and_render_a_column_pair_per_peer(model_dir, tmp_path):
    """vLLM at every batch, llama.cpp (one column per GGUF file) at batch 1 only; the peer
    scripts are stood in for by an interpreter that prints their JSON line."""
    from quanta_lab.bench.peer.checkpoint import engine_ratio

    fake = tmp_path / "fake-python"
    fake.write_text(
        "#!/usr/bin/env bash\n"
        'if [[ "$1" == *llama_cpp_engine.py ]]; then\n'
        '  echo \'{"rows": [{"batch": 1, "decode_tps": 10.0, "prefill_tps": 100.0}]}\'\n'
        "else\n"
        "  echo 'vLLM says hello'\n"
        '  echo \'{"rows": [{"batch": 1, "decode_tps": 20.0, "prefill_tps": 200.0},'
        ' {"batch": 2, "decode_tps": 40.0, "prefill_tps": 400.0}]}\'\n'
        "fi\n"
    )
    fake.chmod(0o755)
    gguf = tmp_path / "model.Q4_1.gguf"
    gguf.write_bytes(b"")
    setup = PeerSetup(
        model_dir=model_dir,
        vllm_python=fake,
        out_dir=tmp_path,
        engine_batches=(1, 2),
        engine_prompt_len=8,
        engine_gen_len=4,
        engine_repeat=1,
        llama_cpp_python=fake,
        llama_cpp_gguf=(gguf,),
    )
    lines: list[str] = []
    engine = engine_ratio(setup, lines.append)
    first, second = engine["rows"]
    assert set(first["peers"]) == {"vllm", "llama.cpp Q4_1"}
    assert set(second["peers"]) == {"vllm"}
    peer = first["peers"]["llama.cpp Q4_1"]
    # NOTE: one round of a few tokens may measure no decode on a busy machine (NaN, said in
    # a note): the ratio is then NaN too
    decode = first["quanta_decode_tps"]
    assert peer["decode_ratio"] == pytest.approx(decode / 10.0, nan_ok=True)
    vllm = first["peers"]["vllm"]["decode_ratio"]
    assert first["decode_ratio"] == pytest.approx(vllm, nan_ok=True)  # earlier keys kept
    assert any("Quanta/llama.cpp Q4_1" in line for line in lines)
    setup_json = {"slo": {"ttft_s": 2.0, "tpot_s": 0.3, "tbt_s": 1.0}, "slo_goal": 0.9}
    markdown = render_markdown({"table": [], "setup": setup_json, "engine": engine})
    assert "llama.cpp Q4_1 decode" in markdown and "vllm decode" in markdown
    assert "| 2 |" in markdown and "- | - | - | - |" in markdown


def test_chat_prompts_are_real_questions_answered_until_eos(model_dir, tmp_path):
    from quanta_lab.bench.quality_data import CHAT_QUESTIONS

    setup = setup_for(model_dir, tmp_path, chat_prompts=True, num_requests=30)
    first, again = workload_for(setup, 1.0), workload_for(setup, 2.0)
    assert [r.prompt for r in first] == [r.prompt for r in again]  # same seed, same questions
    asked = {q for q in CHAT_QUESTIONS for r in first if q in (r.prompt or "")}
    assert len(asked) == len(CHAT_QUESTIONS)  # every question, each in the model's template
    assert all(r.output_tokens == setup.output_tokens[1] for r in first)
    assert all(r.prompt_tokens < 64 for r in first)  # the real length, not the synthetic one
    requests = to_client_requests(first)
    assert all(isinstance(r.prompt, str) for r in requests)


def test_quantized_engine_figures_come_from_the_quantized_engine(model_dir, tmp_path, monkeypatch):
    """``--quantization``: Quanta's engine-only row is timed on the quantized engine (the
    servers and vLLM keep the float checkpoint), and the row names its kernel."""
    from quanta.bench import engine
    from quanta_lab.bench.peer import checkpoint

    timed: list[Path] = []

    def fake_bench(path, *args, **kwargs):
        timed.append(path)
        return []

    monkeypatch.setattr(engine, "run_engine_bench", fake_bench)
    quantized = tmp_path / "int4-engine"
    setup = PeerSetup(
        model_dir=model_dir, vllm_python=None, out_dir=tmp_path, quanta_engine_dir=quantized
    )
    checkpoint.engine_ratio(setup, lambda _: None)
    assert timed == [quantized]


def test_quantization_is_engine_only_on_a_catalogue_model(tmp_path):
    from quanta.cli import app
    from typer.testing import CliRunner

    runner = CliRunner()
    with_servers = runner.invoke(
        app,
        ["bench", "peer", "--no-vllm", "--systems", "quanta-fcfs", "--quantization", "int4",
         "--out", str(tmp_path)],
    )  # fmt: skip
    assert with_servers.exit_code != 0 and "engine-only figures" in with_servers.output
    unknown = runner.invoke(
        app,
        ["bench", "peer", "--no-vllm", "--systems", "", "--quantization", "int3",
         "--out", str(tmp_path)],
    )  # fmt: skip
    assert unknown.exit_code != 0 and "none, int8 or int4" in unknown.output
    bare_table = runner.invoke(
        app,
        ["bench", "peer", "--no-vllm", "--systems", "", "--quantize-embedding",
         "--out", str(tmp_path)],
    )  # fmt: skip
    assert bare_table.exit_code != 0 and "needs --quantization" in bare_table.output
    head = runner.invoke(
        app,
        ["bench", "peer", "--no-vllm", "--systems", "", "--quantization", "int8",
         "--lm-head-quantization", "int2", "--out", str(tmp_path)],
    )  # fmt: skip
    assert head.exit_code != 0 and "int8 or int4" in head.output


def test_vllms_engine_script_pairs_its_runs_as_quantas_bench_does():
    """``bench/peer/vllm_engine.py`` runs in vLLM's venv, so it has its own copy of
    ``paired_rates``: both must turn the same rounds into the same rates."""
    import importlib.util

    from quanta.bench.engine import paired_rates

    script = Path(__file__).resolve().parents[2] / "bench" / "peer" / "vllm_engine.py"
    spec = importlib.util.spec_from_file_location("vllm_engine", script)
    assert spec is not None and spec.loader is not None
    vllm_engine = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(vllm_engine)  # imports vLLM only in main()
    for rounds in ([(2.5, 6.5), (2.0, 6.0), (5.0, 5.2)], [(1.0, 5.0), (3.0, 2.9)], [(1.0, 3.0)]):
        assert vllm_engine.paired_rates(rounds, 4, 16, 9) == paired_rates(rounds, 4, 16, 9)
    assert math.isnan(vllm_engine.paired_rates([(3.0, 2.9)], 1, 8, 5)[1])
