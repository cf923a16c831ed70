"""The metric names the services export (their registries, built the way ServiceHost and each
service build them) and the names docs/observability.md lists; shared by the tests that
compare them (tests/unit/test_observability_names.py, the live trainer in
tests/integration/test_dashboard.py, the Grafana queries in tests/deploy/test_monitoring.py)."""

from __future__ import annotations

import re
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest

from rollstream.core import dashboard, metrics, run_keys, service

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "observability.md"
SERVICES = ("generator", "reward", "reference", "trainer")
_ROW = re.compile(r"^\|\s*`(rollstream_[a-z_<>]+)`\s*\|\s*(counter|gauge|histogram)\s*\|([^|]*)\|([^|]*)\|")


def documented() -> dict[str, tuple[str, bool]]:
    """name -> (type, CUDA only), with <service> expanded to the four services."""
    out: dict[str, tuple[str, bool]] = {}
    for line in DOC.read_text().splitlines():
        m = _ROW.match(line)
        if not m:
            continue
        name, kind, meaning = m.group(1), m.group(2), m.group(4)
        for svc in SERVICES if "<service>" in name else (None,):
            out[name.replace("<service>", svc) if svc else name] = (kind, "CUDA only" in meaning)
    return out


def service_registry(name: str) -> CollectorRegistry:
    """What a running service registers: ServiceHost's stage and process metrics, the service's
    own, and on the trainer the dashboard's pipeline view."""
    registry = CollectorRegistry()
    service.StageMetrics.register(name, registry)
    metrics.register_process(name, registry)
    if name == "generator":
        from rollstream.generator.generator import Metrics
    elif name == "reward":
        from rollstream.reward.scoring import Metrics
    elif name == "reference":
        from rollstream.reference.service import Metrics
    else:
        from rollstream.trainer.trainer import Metrics

        def unreachable():
            raise ConnectionError("no Redis in this test")

        registry.register(dashboard.PipelineView(unreachable, run_keys.RunKeys("names")))
    Metrics.register(registry)
    return registry


def exported() -> dict[str, str]:
    """name -> type over the four services, from their exposition text."""
    out = {}
    for svc in SERVICES:
        for line in generate_latest(service_registry(svc)).decode().splitlines():
            if line.startswith("# TYPE "):
                name, kind = line.split()[2:4]
                out[name + "_total" if kind == "counter" and not name.endswith("_total") else name] = kind
    return out


def documented_trainer_names() -> list[str]:
    """The trainer's documented names that a CPU process exports (for tests of a live trainer)."""
    return sorted(n for n, (_, cuda) in documented().items() if n.startswith("rollstream_trainer_") and not cuda)
