"""The Kubernetes manifests (deploy/kubernetes): valid against the Kubernetes API schemas
(kubernetes-validate, strict: an unknown field fails), and consistent with what Quanta is:
every flag they pass exists, the gateway lists every replica, the replicas reach the Redis
Service, probes hit the real health endpoints, and the grace period covers the drain."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import typer
import yaml
from quanta.cli import app

kubernetes_validate = pytest.importorskip("kubernetes_validate")

DEPLOY = Path(__file__).parent.parent / "deploy" / "kubernetes"


def _docs() -> dict[tuple[str, str], dict[str, Any]]:
    out = {}
    for path in sorted(DEPLOY.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            out[(doc["kind"], doc["metadata"]["name"])] = doc
    return out


DOCS = _docs()


@pytest.mark.parametrize("key", sorted(DOCS), ids=lambda k: f"{k[0]}/{k[1]}")
def test_each_resource_is_valid_kubernetes(key):
    from kubernetes_validate.utils import latest_version

    kubernetes_validate.validate(DOCS[key], latest_version(), strict=True)


def test_the_validator_refuses_an_unknown_field():
    from kubernetes_validate.utils import latest_version

    bad = yaml.safe_load(yaml.safe_dump(DOCS[("StatefulSet", "quanta")]))
    bad["spec"]["replica"] = 2
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, latest_version(), strict=True)


def test_kustomization_lists_every_manifest():
    kustomization = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    files = sorted(p.name for p in DEPLOY.glob("*.yaml") if p.name != "kustomization.yaml")
    assert sorted(kustomization["resources"]) == files


def _options(command: str) -> set[str]:
    cmd = typer.main.get_command(app).commands[command]  # type: ignore[attr-defined]
    return {opt for p in cmd.params for opt in (*p.opts, *p.secondary_opts)}


def _flags(args: list[str]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for flag, value in zip(args, [*args[1:], ""], strict=True):
        if flag.startswith("--"):
            out.setdefault(flag, []).append(value)
    return out


def _container(kind: str, name: str) -> dict[str, Any]:
    return DOCS[(kind, name)]["spec"]["template"]["spec"]["containers"][0]


def test_every_flag_is_quantas_and_the_pieces_meet():
    replicas = DOCS[("StatefulSet", "quanta")]
    engine = _container("StatefulSet", "quanta")
    gateway = _container("Deployment", "quanta-gateway")
    serve = _flags(engine["args"])
    openai = _flags(gateway["args"])
    assert set(serve) <= _options("serve"), set(serve) - _options("serve")
    assert gateway["command"] == ["quanta", "openai"]
    assert set(openai) <= _options("openai"), set(openai) - _options("openai")
    # the gateway lists each replica by its stable name, at the gRPC port
    service = replicas["spec"]["serviceName"]
    grpc = next(p["containerPort"] for p in engine["ports"] if p["name"] == "grpc")
    count = replicas["spec"]["replicas"]
    assert openai["--upstream"] == [f"quanta-{i}.{service}:{grpc}" for i in range(count)]
    # the replicas reach the Redis Service
    redis = DOCS[("Service", "quanta-redis")]["spec"]["ports"][0]["port"]
    assert serve["--state-url"] == [f"redis://quanta-redis:{redis}/0"]
    # probes: Triton's readiness, the gateway's health; the drain fits the grace period
    assert engine["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert gateway["readinessProbe"]["httpGet"]["path"] == "/health"
    grace = replicas["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert float(serve["--drain-timeout"][0]) < grace
