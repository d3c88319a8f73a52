"""The Kubernetes manifests (deploy/kubernetes): valid against the Kubernetes API schemas
(kubernetes-validate, strict: an unknown field fails), and consistent with what Quanta is:
every flag they pass exists, the gateway runs in every replica and is the only port that
leaves a pod, the replicas reach the Redis Service, probes hit the real health endpoints,
and the grace period covers the drain."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import typer
import yaml
from quanta.cli import app

kubernetes_validate = pytest.importorskip("kubernetes_validate")

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"


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
    serve = _flags(engine["args"])
    assert set(serve) <= _options("serve"), set(serve) - _options("serve")
    # the gateway runs in each replica, and the gateway Service selects the replicas' pods
    gateway_port = int(serve["--openai-port"][0])
    http = next(p for p in engine["ports"] if p["name"] == "http")
    assert http["containerPort"] == gateway_port
    service = DOCS[("Service", "quanta-gateway")]["spec"]
    assert service["selector"] == replicas["spec"]["selector"]["matchLabels"]
    assert [p["targetPort"] for p in service["ports"]] == ["http"]
    # the replicas reach the Redis Service
    redis = DOCS[("Service", "quanta-redis")]["spec"]["ports"][0]["port"]
    assert serve["--state-url"] == [f"redis://quanta-redis:{redis}/0"]
    # probes: Triton's readiness and liveness, asked inside the pod; the drain fits the grace
    assert engine["readinessProbe"]["exec"]["command"][-1].endswith(f":{gateway_port}/health")
    assert engine["livenessProbe"]["exec"]["command"][-1].endswith("/v2/health/live")
    grace = replicas["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert float(serve["--drain-timeout"][0]) < grace


def test_no_triton_port_leaves_the_pod():
    """Only the gateway's port is declared or served: Triton's ports stay on the loopback
    (no --triton-host), and the probes ask them from inside the container."""
    engine = _container("StatefulSet", "quanta")
    serve = _flags(engine["args"])
    assert "--triton-host" not in serve
    gateway_port = int(serve["--openai-port"][0])
    assert [p["containerPort"] for p in engine["ports"]] == [gateway_port]
    for (kind, name), doc in DOCS.items():
        if kind == "Service" and name != "quanta-redis":
            assert {p["port"] for p in doc["spec"]["ports"]} == {gateway_port}, name
    for probe in ("readinessProbe", "livenessProbe"):
        assert "127.0.0.1:" in engine[probe]["exec"]["command"][-1]


def test_the_replicas_serve_the_real_model_an_init_container_fetched():
    """An init container runs `quanta fetch-model NAME` into the models volume; `quanta serve`
    is given the same catalogue name and cache, so it serves that engine, not the random-weight
    default."""
    from quanta.build.fetch import CACHE_ENV, CATALOGUE

    pod = DOCS[("StatefulSet", "quanta")]["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    assert init["command"][:2] == ["quanta", "fetch-model"]
    name = init["command"][2]
    assert name in CATALOGUE
    engine = _container("StatefulSet", "quanta")
    assert engine["args"][0] == name  # the model argument of `quanta serve`

    def cache(container: dict[str, Any]) -> str:
        (env,) = [e["value"] for e in container["env"] if e["name"] == CACHE_ENV]
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        return mounts[env]  # the volume mounted where the cache is

    assert cache(init) == cache(engine) == "models"
    claims = DOCS[("StatefulSet", "quanta")]["spec"]["volumeClaimTemplates"]
    assert [c["metadata"]["name"] for c in claims] == ["models"]
    assert pod["securityContext"]["fsGroup"] == 1000  # the image's user, who writes it


MONITORING = DEPLOY / "monitoring"
# The part of the Prometheus Operator's ServiceMonitor schema (monitoring.coreos.com/v1) these
# manifests use. Why by hand: kubernetes-validate holds the Kubernetes API's own schemas and
# no custom resource's, and the operator's CRD is not vendored here.
_SERVICE_MONITOR = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object",
            "required": ["selector", "endpoints"],
            "additionalProperties": False,
            "properties": {
                "selector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {"matchLabels": {"type": "object"}},
                },
                "endpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "required": ["port"],
                        "additionalProperties": False,
                        "properties": {
                            "port": {"type": "string"},
                            "path": {"type": "string", "pattern": "^/"},
                            "interval": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"},
                            "scrapeTimeout": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"},
                        },
                    },
                },
            },
        },
    },
}


def test_the_service_monitor_scrapes_each_replicas_gateway_metrics():
    import jsonschema

    kustomization = yaml.safe_load((MONITORING / "kustomization.yaml").read_text())
    assert kustomization["resources"] == ["servicemonitor.yaml"]
    monitor = yaml.safe_load((MONITORING / "servicemonitor.yaml").read_text())
    jsonschema.validate(monitor, _SERVICE_MONITOR)
    # it selects the headless Service (one endpoint per pod), not the balancing one
    selected = [
        name
        for (kind, name), doc in DOCS.items()
        if kind == "Service"
        and monitor["spec"]["selector"]["matchLabels"].items() <= doc["metadata"]["labels"].items()
    ]
    assert selected == ["quanta"]
    ports = {p["name"] for p in DOCS[("Service", "quanta")]["spec"]["ports"]}
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] in ports and endpoint["path"] == "/metrics"
    assert int(endpoint["scrapeTimeout"][:-1]) < int(endpoint["interval"][:-1])


def test_the_prometheus_config_scrapes_the_gateway_port():
    config = yaml.safe_load((DEPLOY.parent / "prometheus" / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    serve = _flags(_container("StatefulSet", "quanta")["args"])
    port = serve["--openai-port"][0]
    assert jobs["quanta"]["static_configs"][0]["targets"] == [f"127.0.0.1:{port}"]
    pods = jobs["quanta-kubernetes"]
    kept = {
        r["source_labels"][0]: r["regex"]
        for r in pods["relabel_configs"]
        if r.get("action") == "keep"
    }
    http = next(p for p in _container("StatefulSet", "quanta")["ports"] if p["name"] == "http")
    assert kept["__meta_kubernetes_pod_container_port_name"] == http["name"]
    name = DOCS[("StatefulSet", "quanta")]["spec"]["template"]["metadata"]["labels"]
    assert (
        kept["__meta_kubernetes_pod_label_app_kubernetes_io_name"]
        == (name["app.kubernetes.io/name"])
    )
    for job in jobs.values():
        assert job["metrics_path"] == "/metrics"
