"""HostAdamW's traffic between the compute device and the host (optimizer.py): the copier, and
where a bucket's gradients come from, chosen once when the optimizer is made.

Device gradients (DeviceGrads): backward leaves them on the device; a step fetches them a
bucket at a time into pinned staging on a side stream, the next bucket's coming down while
the CPU works on this one. On a GPU they come down in the parameters' dtype (bf16: half the
bytes over the bus; fp32 when the dtypes are mixed, so that none loses precision) and the CPU
widens them to fp32; on the CPU they are widened straight into the fp32 staging.

Gradient offload (OffloadedGrads, `grad_offload`, grad_offload.py): each parameter's gradient
leaves the device as backward produces it and is added into an fp32 host accumulator (4 more
bytes a parameter); the step, grad_norm and discard_grads wait for the pending adds first.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from rollstream.trainer.grad_offload import GradOffload
from rollstream.trainer.masters import Bucket, Layout, buckets_of, flat


class Copier:
    """Device<->host copies of bucket slices: async with events and side streams on CUDA,
    plain synchronous copies on the CPU. The same call sequence runs in both cases."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.d2h: torch.cuda.Stream | None = torch.cuda.Stream(device) if self.cuda else None
        self.h2d: torch.cuda.Stream | None = torch.cuda.Stream(device) if self.cuda else None

    def begin(self) -> None:
        """Gradients were produced on the compute stream: copies must wait for them."""
        if self.d2h is not None:
            self.d2h.wait_stream(torch.cuda.current_stream(self.d2h.device))

    def copy(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], stream: "torch.cuda.Stream | None") -> torch.cuda.Event | None:
        """Copy each (source -> destination) on `stream` (d2h or h2d); returns an event to wait for."""
        if not self.cuda:
            for src, dst in pairs:
                dst.copy_(src)
            return None
        with torch.cuda.stream(stream):
            for src, dst in pairs:
                dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        return event

    @staticmethod
    def wait(event: torch.cuda.Event | None) -> None:
        if event is not None:
            event.synchronize()

    def end(self) -> None:
        """The next forward (compute stream) must see the updated weights."""
        if self.h2d is not None:
            torch.cuda.current_stream(self.h2d.device).wait_stream(self.h2d)


class Grads:
    """Where a step's gradients come from: norm() before the step, begin() and bucket(k) for
    each bucket in order during it, drop() after it."""

    offload: GradOffload | None = None

    def __init__(self, params: Mapping[str, torch.nn.Parameter], buckets: list[Bucket]):
        self.params, self.buckets = params, buckets

    def drop(self) -> None:
        for p in self.params.values():
            p.grad = None


class DeviceGrads(Grads):
    """The gradients backward left in the parameters, fetched a bucket at a time. `wide`:
    the gradient dtypes the masters' step reads itself; others are widened into fp32 first."""

    def __init__(self, params: Mapping[str, torch.nn.Parameter], buckets: list[Bucket], copier: Copier, wide: frozenset[torch.dtype]):
        super().__init__(params, buckets)
        self.copier = copier
        width, dtypes = max(b.size for b in buckets), {p.dtype for p in params.values()}
        dtype = dtypes.pop() if copier.cuda and len(dtypes) == 1 else torch.float32
        # Two slots, so that bucket k+1 can come down while the CPU works on bucket k.
        self._staging = [torch.empty(width, dtype=dtype, pin_memory=copier.cuda) for _ in range(2)]
        self._grad32 = torch.empty(width) if dtype not in wide else None
        # The parameters whose last piece is in bucket k: their device gradients may go once
        # bucket k's have come down (an overlapped update's next forward needs the room).
        self._last_in: list[list[str]] = [[] for _ in buckets]
        for name, held in buckets_of(params, buckets).items():
            if held:  # (an empty parameter is in no bucket)
                self._last_in[held[-1]].append(name)
        self._fetched: torch.cuda.Event | None = None

    def norm(self) -> float:
        grads = [p.grad for p in self.params.values() if p.grad is not None]
        if grads and self.copier.cuda:  # CUDA reductions are trees: fp32 accumulation is accurate enough.
            norms = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads])
            return float(torch.linalg.vector_norm(norms))
        return host_norm(grads)

    def begin(self) -> None:
        self._fetched = self._fetch(0)

    def bucket(self, k: int) -> torch.Tensor:
        """Bucket k's gradients on the host (fetching bucket k+1's meanwhile)."""
        next_fetch = self._fetch(k + 1) if k + 1 < len(self.buckets) else None
        self.copier.wait(self._fetched)
        self._fetched = next_fetch
        for name in self._last_in[k]:
            self.params[name].grad = None  # on the host now, in full
        grad = self._staging[k % 2][: self.buckets[k].size]
        return grad if self._grad32 is None else self._grad32[: grad.numel()].copy_(grad)

    def _fetch(self, k: int) -> torch.cuda.Event | None:
        """Start bringing bucket k's gradients into the staging slot k % 2."""
        b, staging = self.buckets[k], self._staging[k % 2]
        pairs = []
        for pc in b.pieces:
            p = self.params[pc.name]
            dst = staging[pc.bucket_start : pc.bucket_start + pc.count]
            if p.grad is None:
                dst.zero_()  # a parameter outside the graph: zero gradient, as torch's AdamW with grads of 0
            else:
                pairs.append((flat(p.grad)[pc.param_start : pc.param_start + pc.count], dst))
        return self.copier.copy(pairs, self.copier.d2h)


class OffloadedGrads(Grads):
    """The gradients the offload's hooks added into its fp32 host accumulator."""

    offload: GradOffload

    def __init__(self, params: Mapping[str, torch.nn.Parameter], layout: Layout, buckets: list[Bucket]):
        super().__init__(params, buckets)
        self.layout, self.offload = layout, GradOffload(params, layout, slot_bytes=max(b.size for b in buckets) * 4)

    def norm(self) -> float:
        self.begin()
        return host_norm([self.offload.accumulator[off : off + n] for off, n, _ in self.layout.values()])

    def begin(self) -> None:
        self.offload.wait()  # every add issued by backward is in the accumulator

    def bucket(self, k: int) -> torch.Tensor:
        return self.offload.accumulator[self.buckets[k].start : self.buckets[k].end]

    def drop(self) -> None:
        super().drop()
        self.offload.zero()


_NORM_ROW = 4096
_NORM_CHUNK = 256 * _NORM_ROW  # elements widened to fp32 at a time (4 MiB of scratch)


def host_norm(grads: list[torch.Tensor]) -> float:
    scratch = torch.empty(_NORM_CHUNK if grads else 0, dtype=torch.float32)
    return math.sqrt(sum(_sum_of_squares(g, scratch) for g in grads))


def _sum_of_squares(t: torch.Tensor, scratch: torch.Tensor) -> float:
    """Sum of squares of a CPU tensor, accurately and fast. torch's fp32 CPU reduction keeps
    one long accumulation per SIMD lane and is off by ~0.4% over 50M elements; fp64 is exact
    but ~25x slower. So: rows of 4096 elements reduced in fp32 (short accumulations), the rows
    added up in fp64. Rows sit at fixed positions of the tensor, so the result depends only
    on the values (not on the dtype they come in, nor on any bucket size)."""
    values = t.reshape(-1)
    total = 0.0
    for start in range(0, values.numel(), _NORM_CHUNK):
        piece = values[start : start + _NORM_CHUNK]
        x = piece if piece.dtype == torch.float32 else scratch[: piece.numel()].copy_(piece)
        full = x.numel() // _NORM_ROW * _NORM_ROW
        if full:
            rows = torch.linalg.vector_norm(x[:full].view(-1, _NORM_ROW), dim=1)
            total += float(rows.double().square().sum())
        if full < x.numel():
            total += float(torch.linalg.vector_norm(x[full:], dtype=torch.float64)) ** 2
    return total
