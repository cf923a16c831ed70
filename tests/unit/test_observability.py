"""Metric names: every service's registry, built the way ServiceHost and the service build it,
exports exactly the names docs/observability.md lists (with `<service>` expanded for the
common ones; the CUDA-only ones where torch has no GPU are not required), and every name
follows the rule rollstream_<service>_..."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from rollstream.core import dashboard, metrics, service, streams

ROOT = Path(__file__).resolve().parents[2]
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

        registry.register(dashboard.PipelineView(unreachable, streams.RunKeys("names")))
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


def test_the_doc_lists_exactly_the_exported_names() -> None:
    doc, got = documented(), exported()
    assert doc, "no metric rows found in docs/observability.md"
    missing_from_doc = sorted(set(got) - set(doc))
    assert not missing_from_doc, f"exported, not in docs/observability.md: {missing_from_doc}"
    not_exported = sorted(n for n, (_, cuda) in doc.items() if n not in got and not cuda)
    assert not not_exported, f"documented, not exported: {not_exported}"
    wrong_type = sorted(n for n in got if doc[n][0] != got[n])
    assert not wrong_type, f"type differs from the doc: {[(n, doc[n][0], got[n]) for n in wrong_type]}"


def test_names_follow_the_rule() -> None:
    for name, kind in exported().items():
        assert re.fullmatch(r"rollstream_(generator|reward|reference|trainer)_[a-z0-9_]+", name), name
        assert "_created" not in name, name
        if kind == "counter":
            assert name.endswith("_total"), name
        else:
            assert not name.endswith("_total"), name


def test_exported_names_helper_matches() -> None:
    assert metrics.exported_names(service_registry("reward")) == {n for n in exported() if n.startswith("rollstream_reward_")}


def test_gpu_collector_is_silent_without_cuda() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the GPU gauges are exported here")
    assert list(metrics.GpuMemoryCollector("trainer").collect()) == []
