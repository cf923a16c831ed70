"""docs/observability.md lists exactly the metric names the four services export, and every
name follows the rule rollstream_<service>_... (tests/metric_names.py builds the registries
the way ServiceHost and each service do)."""

from __future__ import annotations

import re

import pytest

from metric_names import documented, exported, service_registry
from rollstream.core import metrics


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
    assert metrics.exported_names(service_registry("reward")) == {
        n for n in exported() if n.startswith("rollstream_reward_")
    }


def test_gpu_collector_is_silent_without_cuda() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the GPU gauges are exported here")
    assert list(metrics.GpuMemoryCollector("trainer").collect()) == []


def test_gpu_collector_reads_torch_cuda_per_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA path without a GPU: a stand-in for the torch.cuda calls the collector makes
    (tests/gpu runs the real trainer on a GPU)."""
    import sys
    import types

    cuda = types.SimpleNamespace(
        is_available=lambda: True,
        is_initialized=lambda: True,
        device_count=lambda: 2,
        memory_allocated=lambda i: 1000.0 * (i + 1),
        max_memory_allocated=lambda i: 5000.0 * (i + 1),
    )
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda))
    families = {f.name: f for f in metrics.GpuMemoryCollector("trainer").collect()}
    assert {s.labels["device"]: s.value for s in families["rollstream_trainer_gpu_memory_allocated_bytes"].samples} == {
        "0": 1000.0,
        "1": 2000.0,
    }
    assert {
        s.labels["device"]: s.value for s in families["rollstream_trainer_gpu_memory_max_allocated_bytes"].samples
    } == {"0": 5000.0, "1": 10000.0}
    doc = documented()
    assert all(doc[name][1] for name in families)  # documented as CUDA only
