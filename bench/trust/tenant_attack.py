"""The rotating-name (Sybil) attack on fair scheduling, against a running OpenAI gateway.

A steady victim (``--victims`` closed-loop clients, tenant ``victim``) sends completions for
``--seconds`` in three phases: alone; beside ``--attackers`` closed-loop clients that all
send as one tenant (``attacker``); and beside as many that send each request under a name
never used before (``attacker-<n>``). It prints how many requests the victim completed in
each phase (and the attackers), as a table and, with ``--json``, as one JSON object.

Under ``--policy fair`` a name the server trusts gets its own service counter; a client that
invents a fresh name per request would otherwise be owed a fresh share each time. Compare
the phases under ``fair`` and ``fcfs`` (and ``fair`` with ``--policy-option
unauthenticated_tenants=min``, the names-are-trusted behaviour).

    python bench/trust/tenant_attack.py --url http://127.0.0.1:9000 --model quanta --seconds 45

The tenant is sent as OpenAI's ``user``. With API keys on the gateway, ``--api-key`` is every
client's key (the tenant is then the key's, so the attack names nothing);
``--victim-key``/``--attacker-key`` give the victim and the attackers keys of their own.
Needs only the standard library; the server must be running. A completion counts in a phase
when it finished before the phase's end; each phase waits for its requests in flight before
the next starts.
"""

from __future__ import annotations

import argparse
import itertools
import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

Send = Callable[[str], bool]
"""Send one request as the given tenant; True when it completed."""


def openai_sender(
    url: str,
    model: str,
    *,
    key: str | None = None,
    max_tokens: int = 16,
    prompt: str = "Tell me a story about a lighthouse keeper.",
    timeout: float = 120.0,
) -> Send:
    """One non-streamed ``/v1/completions`` request per call, tenant as ``user``."""
    endpoint = url.rstrip("/").removesuffix("/v1") + "/v1/completions"
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"

    def send(tenant: str) -> bool:
        body = {
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "user": tenant,
        }
        req = urllib.request.Request(endpoint, json.dumps(body).encode(), headers)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return 200 <= resp.status < 300 and bool(json.loads(resp.read())["choices"])
        except (urllib.error.URLError, OSError, ValueError, KeyError):
            return False

    return send


@dataclass
class Tally:
    """Completions (and failures) of one kind of client within a phase."""

    completed: int = 0
    failed: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def note(self, ok: bool, in_time: bool) -> None:
        with self.lock:
            if not ok:
                self.failed += 1
            elif in_time:
                self.completed += 1


def _client(send: Send, names: Callable[[], str], deadline: float, tally: Tally) -> None:
    """Closed loop: the next request goes when the last one is answered."""
    while time.monotonic() < deadline:
        ok = send(names())
        tally.note(ok, time.monotonic() <= deadline)


def run_phase(
    victim: Send,
    attacker: Send | None,
    *,
    seconds: float,
    victims: int = 1,
    attackers: int = 8,
    rotate: bool = False,
) -> dict[str, int]:
    """One phase: the victims (and attackers, if ``attacker``) for ``seconds``; the counts.

    The attackers start first, so that their queue is there when the victim's first request
    arrives (the attack, not its warm-up, is measured)."""
    counter = itertools.count()
    lock = threading.Lock()

    def fresh() -> str:
        with lock:
            return f"attacker-{next(counter)}"

    start = time.monotonic()
    deadline = start + seconds
    v, a = Tally(), Tally()
    threads = []
    if attacker is not None:
        names = fresh if rotate else (lambda: "attacker")
        for _ in range(attackers):
            threads.append(threading.Thread(target=_client, args=(attacker, names, deadline, a)))
    for _ in range(victims):
        threads.append(
            threading.Thread(target=_client, args=(victim, lambda: "victim", deadline, v))
        )
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {
        "victim_completed": v.completed,
        "victim_failed": v.failed,
        "attacker_completed": a.completed,
        "attacker_failed": a.failed,
        "attacker_names": next(counter) if rotate else (1 if attacker is not None else 0),
    }


PHASES = ("alone", "one_name", "rotating")


def attack(
    victim: Send,
    attacker: Send,
    *,
    seconds: float,
    victims: int = 1,
    attackers: int = 8,
    phases: tuple[str, ...] = PHASES,
) -> dict[str, dict[str, int]]:
    """Every phase in turn (``PHASES``), each ``seconds`` long."""
    out = {}
    for phase in phases:
        out[phase] = run_phase(
            victim,
            None if phase == "alone" else attacker,
            seconds=seconds,
            victims=victims,
            attackers=attackers,
            rotate=phase == "rotating",
        )
    return out


def _table(results: dict[str, dict[str, int]], seconds: float) -> str:
    rows = [f"phase ({seconds:g} s each) | victim completed | attacker completed | names"]
    rows.append("---|---|---|---")
    for phase, r in results.items():
        failed = f" ({r['victim_failed']} failed)" if r["victim_failed"] else ""
        rows.append(
            f"{phase} | {r['victim_completed']}{failed} | {r['attacker_completed']} | "
            f"{r['attacker_names']}"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:9000", help="the gateway")
    parser.add_argument("--model", default="quanta", help="the served model name")
    parser.add_argument("--seconds", type=float, default=45.0, help="each phase's length")
    parser.add_argument("--victims", type=int, default=1, help="victim clients (closed loop)")
    parser.add_argument("--attackers", type=int, default=8, help="attacker clients")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens per completion")
    parser.add_argument("--prompt", default="Tell me a story about a lighthouse keeper.")
    parser.add_argument("--phases", default=",".join(PHASES), help="some of " + ",".join(PHASES))
    parser.add_argument("--api-key", default=None, help="every client's key")
    parser.add_argument("--victim-key", default=None, help="the victim's key (default --api-key)")
    parser.add_argument("--attacker-key", default=None, help="the attackers' key")
    parser.add_argument("--timeout", type=float, default=120.0, help="per request")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead")
    args = parser.parse_args(argv)
    phases = tuple(p.strip() for p in args.phases.split(",") if p.strip())
    unknown = [p for p in phases if p not in PHASES]
    if unknown or args.seconds <= 0 or args.victims < 1 or args.attackers < 1:
        parser.error(f"phases are {', '.join(PHASES)}; seconds > 0; at least one client each")

    def sender(key: str | None) -> Send:
        return openai_sender(
            args.url,
            args.model,
            key=key or args.api_key,
            max_tokens=args.max_tokens,
            prompt=args.prompt,
            timeout=args.timeout,
        )

    results = attack(
        sender(args.victim_key),
        sender(args.attacker_key),
        seconds=args.seconds,
        victims=args.victims,
        attackers=args.attackers,
        phases=phases,
    )
    report: dict[str, Any] = {"seconds": args.seconds, "attackers": args.attackers, **results}
    print(json.dumps(report) if args.json else _table(results, args.seconds))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
