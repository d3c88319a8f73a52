"""FCFS, Apt-Serve with the KV cache only, and Apt-Serve with the hybrid cache on the real CPU
engine: one bursty ShareGPT-like replay each, through a live Triton server, in one run.

The server runs the given preset (or checkpoint) with a small device pool, so memory is what
limits the batch, as in Apt-Serve's experiments. ``apt`` schedules with this engine's own
measured costs (``quanta profile``, which includes the hidden cache's rho), and the SLO is
scaled to the engine. Prints each system's SLO attainment (TTFT and P99 time between tokens,
Apt-Serve's definition), goodput and latencies (``quanta bench serve``).

    python loadtests/apt_cpu_row.py --preset opt-tiny --num-requests 150 --rate 3 --cv 5
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from quanta.build.checkpoint import ensure_checkpoint
from quanta.frontends.triton.launcher import ServerOptions, TritonServer
from quanta.frontends.triton.repository import write_model_repository

SYSTEMS = {
    "fcfs": ("fcfs", {}),
    "apt, KV cache only": ("apt", {"cache": "kv"}),
    "apt, hybrid cache": ("apt", {"cache": "hybrid"}),
}


def _quanta(*args: str) -> None:
    """The ``quanta`` command of this interpreter's environment."""
    subprocess.run([str(Path(sys.executable).parent / "quanta"), *args], check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="opt-tiny", help="random-weight preset to build")
    parser.add_argument("--model-dir", type=Path, help="serve this checkpoint instead")
    parser.add_argument("--num-requests", type=int, default=150)
    parser.add_argument("--rate", type=float, default=3.0, help="requests/s")
    parser.add_argument("--cv", type=float, default=5.0, help="arrival burstiness")
    parser.add_argument("--device-blocks", type=int, default=64, help="device pool, blocks")
    parser.add_argument("--ttft-slo", type=float, default=2.0, help="seconds")
    parser.add_argument("--tbt-slo", type=float, default=0.5, help="seconds")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="quanta-apt-") as tmp:
        root = Path(tmp)
        model_dir = args.model_dir or ensure_checkpoint(args.preset, root / args.preset)
        max_len = json.loads((model_dir / "config.json").read_text())["max_position_embeddings"]
        workload, profile = root / "sharegpt.jsonl", root / "profile.json"
        _quanta(
            "bench", "workload", str(workload), "--dataset", "sharegpt",
            "--num-requests", str(args.num_requests), "--rate", str(args.rate),
            "--cv", str(args.cv), "--seed", str(args.seed), "--max-len", str(max_len - 8),
        )  # fmt: skip
        _quanta(
            "profile", "--model", str(model_dir), "--output", str(profile),
            "--calibration-seconds", "0", "--repeats", "1",
        )  # fmt: skip
        summaries = {}
        for label, (policy, options) in SYSTEMS.items():
            if policy == "apt":
                slo = {"ttft_slo_s": args.ttft_slo, "tbt_slo_s": args.tbt_slo}
                options = options | slo | {"profile": str(profile)}
            overrides = {
                "model_dir": str(model_dir),
                "preset": "",
                "policy": policy,
                "policy_options": json.dumps(options),
                "num_device_blocks": str(args.device_blocks),
                "num_host_blocks": "0",
                "max_num_seqs": "256",
            }
            name = policy + options.get("cache", "")
            repo = write_model_repository(root / f"models-{name}", overrides=overrides)
            options_ = ServerOptions(repo, http_port=0, grpc_port=0, metrics_port=0)
            out = root / f"{name}.json"
            with TritonServer(options_, log_file=root / f"{name}.log") as server:
                _quanta(
                    "bench", "serve", "--url", server.grpc_url, "--workload", str(workload),
                    "--ttft-slo", str(args.ttft_slo), "--tbt-slo", str(args.tbt_slo),
                    "--output", str(out),
                )  # fmt: skip
            summaries[label] = json.loads(out.read_text())["runs"][0]["summary"]
    print(
        f"\n{args.num_requests} ShareGPT-like requests, rate {args.rate}/s, CV {args.cv}, "
        f"{args.device_blocks} device blocks; SLO TTFT {args.ttft_slo} s, "
        f"P99 TBT {args.tbt_slo} s"
    )
    print("| system | SLO attainment | goodput req/s | errors |")
    print("|---|---|---|---|")
    for label, s in summaries.items():
        print(
            f"| {label} | {100 * s['slo_attainment']:.1f}% | {s['goodput_rps']:.2f} "
            f"| {s['num_errors']} |"
        )


if __name__ == "__main__":
    main()
