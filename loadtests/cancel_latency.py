"""How late a disconnect stops a request: tokens generated for a stream after its client went
away, while other streams keep the server busy.

Starts its own Triton server (``quanta serve``'s launcher) on free ports with the given
preset or checkpoint, and for each concurrency and transport: ``N - 1`` streams run to the
end, one more reads 5 tokens and disconnects. The server's ``quanta_generation_tokens_total``
before and after, minus everything the full streams and the reader got, is what was generated
for nobody; with one token per decode step that is the number of steps the cancellation took
(``quanta_lab.bench.cancel``).

    python loadtests/cancel_latency.py --preset opt-125m --streams 20,50 --tokens 150
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from quanta.build.checkpoint import ensure_checkpoint
from quanta.frontends.triton.launcher import ServerOptions, TritonServer
from quanta.frontends.triton.repository import write_model_repository
from quanta_lab.bench.cancel import tokens_after_disconnect


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="opt-125m", help="random-weight preset to build")
    parser.add_argument("--model-dir", type=Path, help="serve this checkpoint instead")
    parser.add_argument("--streams", default="20,50", help="concurrent streams, comma-separated")
    parser.add_argument("--tokens", type=int, default=150, help="tokens per full stream")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="quanta-cancel-") as tmp:
        root = Path(tmp)
        model_dir = args.model_dir or ensure_checkpoint(args.preset, root / args.preset)
        overrides = {
            "model_dir": str(model_dir),
            "preset": "",  # built above (or given); not the default tiny preset
            "num_host_blocks": "0",
            "max_num_seqs": "64",
            "metrics_interval_ms": "50",
        }
        repo = write_model_repository(root / "models", overrides=overrides)
        options = ServerOptions(repo, http_port=0, grpc_port=0, metrics_port=0)
        with TritonServer(options, log_file=root / "triton.log") as server:
            for streams in (int(s) for s in args.streams.split(",") if s.strip()):
                for transport in ("http", "grpc"):
                    for _ in range(args.repeats):
                        after, ms = tokens_after_disconnect(server, streams, args.tokens, transport)
                        print(
                            f"{streams} streams, {transport}: {after} tokens generated after "
                            f"the disconnect (a step took ~{ms:.0f} ms per token)",
                            flush=True,
                        )


if __name__ == "__main__":
    main()
