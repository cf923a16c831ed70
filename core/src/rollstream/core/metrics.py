"""What every service exports besides its own metrics: its process (resident memory, CPU,
file descriptors) and, where CUDA is in use, its GPU memory. Registered by ServiceHost on
the service's own registry, under the service's prefix (rollstream_<service>_...).

Names follow one rule everywhere (docs/observability.md lists every one):
`rollstream_<service>_<what>[_<unit>]`, units spelled out (`_seconds`, `_bytes`, `_versions`),
counters ending `_total` (prometheus_client appends it to the name a Counter is given).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, ProcessCollector, disable_created_metrics
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

# No `<name>_created` series next to every counter and histogram: in the text format they are
# one more gauge per metric that no panel uses (process-wide; services import this module).
disable_created_metrics()


def prefix(service: str) -> str:
    return f"rollstream_{service}_"


class GpuMemoryCollector(Collector):
    """torch.cuda memory per device, at scrape time. Only when torch is already imported by
    the service (the reward service never imports it) and CUDA is available and initialised:
    a scrape must not be what imports torch or creates a CUDA context."""

    def __init__(self, service: str):
        self.p = prefix(service)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        torch = sys.modules.get("torch")
        if torch is None:
            return
        try:
            if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
                return
            allocated = GaugeMetricFamily(
                self.p + "gpu_memory_allocated_bytes",
                "bytes held by tensors on the GPU (torch.cuda.memory_allocated)",
                labels=["device"],
            )
            peak = GaugeMetricFamily(
                self.p + "gpu_memory_max_allocated_bytes",
                "peak bytes held by tensors on the GPU (torch.cuda.max_memory_allocated)",
                labels=["device"],
            )
            for i in range(torch.cuda.device_count()):
                allocated.add_metric([str(i)], float(torch.cuda.memory_allocated(i)))
                peak.add_metric([str(i)], float(torch.cuda.max_memory_allocated(i)))
        except Exception:  # noqa: BLE001 - a scrape never fails for the GPU's sake
            return
        yield allocated
        yield peak


def register_process(service: str, registry: CollectorRegistry) -> None:
    """rollstream_<service>_process_* (prometheus_client's ProcessCollector: resident and
    virtual memory, CPU seconds, open and max fds, start time; Linux /proc) and the GPU
    memory collector."""
    ProcessCollector(namespace=f"rollstream_{service}", registry=registry)
    registry.register(GpuMemoryCollector(service))


def exported_names(registry: CollectorRegistry) -> set[str]:
    """The metric family names a registry exposes (as /metrics's `# TYPE` lines name them:
    counters with their `_total`)."""
    from prometheus_client import generate_latest

    names = set()
    for line in generate_latest(registry).decode().splitlines():
        if line.startswith("# TYPE ") and not line.split()[2].endswith("_created"):
            name, kind = line.split()[2:4]
            names.add(name + "_total" if kind == "counter" and not name.endswith("_total") else name)
    return names
