"""Quanta and vLLM side by side: one checkpoint, one seeded workload, one client.

Why this shape: a comparison is only fair if everything but the server is held fixed. Each
system is started once (vLLM's OpenAI server from its own virtual environment, or ``quanta
serve --openai-port``), warmed up, and fed the *same* requests per rate through the *same*
client (``quanta.bench.client.replay`` over ``/v1/completions``, prompts as token ids, greedy,
``ignore_eos``) with the same torch thread count, KV-cache bytes and batch limits. Metrics come
from ``quanta.metrics``. Two checks keep the numbers honest: vLLM's own ``bench serve``
(a third-party client) is run against the servers next to our client on a matching workload,
and the engine-only decode tokens/s of both engines are measured offline on identical token
ids (``quanta.bench.engine`` for Quanta, ``bench/peer/vllm_engine.py`` in vLLM's venv).

Everything binds to 127.0.0.1. Raw results, summaries, logs and plots go to ``out_dir``.

Modules: ``config`` (``PeerSetup``), ``servers`` (the two server processes), ``runs`` (replay
per rate, warm-up, the ``vllm bench serve`` check, the whole comparison), ``checkpoint`` (the
full-vocabulary tokenizer, the engine-only ratio), ``report`` (table, Markdown, plot) and
``cli`` (``quanta bench peer``).
"""

from __future__ import annotations

from quanta_lab.bench.peer.checkpoint import engine_ratio, full_vocab_checkpoint
from quanta_lab.bench.peer.config import SYSTEMS, VLLM_PRIORITIES, GiB, PeerSetup
from quanta_lab.bench.peer.report import machine_info, plot, render_markdown, side_by_side
from quanta_lab.bench.peer.runs import (
    ensure_sj_profile,
    replay_workload,
    request_priority,
    run_peer,
    run_system,
    vllm_bench_check,
    workload_for,
)
from quanta_lab.bench.peer.servers import (
    QuantaServer,
    Server,
    VllmServer,
    free_port,
    kv_bytes_per_block,
    make_server,
    prometheus_total,
    vllm_env,
)

__all__ = [
    "SYSTEMS",
    "VLLM_PRIORITIES",
    "GiB",
    "PeerSetup",
    "QuantaServer",
    "Server",
    "VllmServer",
    "engine_ratio",
    "ensure_sj_profile",
    "free_port",
    "full_vocab_checkpoint",
    "kv_bytes_per_block",
    "machine_info",
    "make_server",
    "plot",
    "prometheus_total",
    "render_markdown",
    "replay_workload",
    "request_priority",
    "run_peer",
    "run_system",
    "side_by_side",
    "vllm_bench_check",
    "vllm_env",
    "workload_for",
]
