"""HostAdamW's traffic between the compute device and the host (optimizer.py): the copier,
and where a bucket's gradients come from, chosen once when the optimizer is made.

Device gradients (DeviceGrads): backward leaves them on the device; a step fetches them a
bucket at a time into pinned staging on a side stream, the next bucket's coming down while
the CPU works on this one. On a GPU they come down in the parameters' dtype (bf16: half the
bytes over the bus; fp32 when the dtypes are mixed, so that none loses precision) and the CPU
widens them to fp32; on the CPU they are widened straight into the fp32 staging.

Gradient offload (GradOffload, `grad_offload`): a post-accumulate-grad hook hands each
gradient over as backward produces it, in its own dtype, in slices copied into a ring of
pinned slots on a side stream (record_stream frees it on the device once copied; a full ring
makes the hook wait); one host thread adds the slices, widened to fp32, into the host
accumulator in the order the hooks fired: the bits of a synchronous `acc += grad.float()`.
wait() is the barrier the step, grad_norm and discard_grads pass first; a failure in the host
thread is raised there, the broken accumulation zeroed. docs/design-notes.md, "Gradient
offload off backward's critical path".
On a CPU-only machine the same code runs with plain copies and no streams or events.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from rollstream.trainer.masters import Bucket, Layout, buckets_of, flat, local

# A slot's size in bytes is rounded down to a multiple of this: a whole number of elements
# of any gradient dtype (fp64 at most).
_SLOT_ALIGN = 8


class _Pending:
    """One offloader's slices in flight: counted, so that wait() can block until none are
    left, and the first failure among them."""

    def __init__(self) -> None:
        self._done = threading.Condition()
        self.count = 0
        self.failed: list[BaseException] = []

    def add(self) -> None:
        with self._done:
            self.count += 1

    def finished(self) -> None:
        with self._done:
            self.count -= 1
            if self.count == 0:
                self._done.notify_all()

    def wait(self) -> None:
        with self._done:
            self._done.wait_for(lambda: self.count == 0)


@dataclass(frozen=True)
class _Add:
    """One slice on its way: `src` (a view of staging slot `slot`, given back to `free`
    after) is added into `dst` (a view of the accumulator) once `event` (CUDA; None on the
    CPU) says the copy is done."""

    slot: int
    src: torch.Tensor
    dst: torch.Tensor
    event: torch.cuda.Event | None
    free: queue.Queue[int]
    pending: _Pending


def _add(dst: torch.Tensor, src: torch.Tensor) -> None:
    """fp32 += the slice widened to fp32 (torch computes a mixed-dtype add in fp32: the
    same bits as adding src.float(), without a scratch copy)."""
    dst.add_(src)


def _drain(work: queue.Queue[_Add]) -> None:
    """The host thread: adds slices in queue order, forever."""
    while True:
        item = work.get()
        try:
            if item.event is not None:
                item.event.synchronize()
            if not item.pending.failed:  # after a failure the accumulation is dropped anyway
                _add(item.dst, item.src)
        except BaseException as e:  # noqa: BLE001 - kept for wait() to raise on the caller's thread
            item.pending.failed.append(e)
        finally:
            item.free.put(item.slot)
            item.pending.finished()


# One host thread for the process, started on first use, that never ends. A thread that
# ends while the interpreter exits, after running torch's parallel CPU kernels, aborted the
# process ("terminate called without an active exception", 3 exits in 30); a thread blocked
# on an empty queue is simply gone with the process.
_work: queue.Queue[_Add] = queue.Queue()
_thread: threading.Thread | None = None
_start = threading.Lock()


def _host_thread() -> queue.Queue[_Add]:
    global _thread
    with _start:
        if _thread is None:
            _thread = threading.Thread(target=_drain, args=(_work,), name="grad-offload", daemon=True)
            _thread.start()
    return _work


def _after_fork() -> None:
    """A forked child has no host thread (and the queue's lock may be held): start afresh."""
    global _work, _thread, _start
    _work, _thread, _start = queue.Queue(), None, threading.Lock()


os.register_at_fork(after_in_child=_after_fork)


class GradOffload:
    """The fp32 host accumulator of `params`' gradients (`accumulator`, flat, at each
    parameter's offset in `layout`: name -> (offset, numel, shape)) and the hooks, staging
    ring and host thread that fill it. `slots` staging slots of `slot_bytes` each (pinned
    when the parameters are on a GPU). As the step's gradients: DeviceGrads' methods."""

    def __init__(self, params: Mapping[str, torch.nn.Parameter], layout: Layout, *, slot_bytes: int, slots: int = 4):
        if slots < 1:
            raise ValueError(f"gradient offload needs at least one staging slot, not {slots}")
        slot_bytes = slot_bytes // _SLOT_ALIGN * _SLOT_ALIGN
        if slot_bytes < _SLOT_ALIGN:
            raise ValueError(f"a gradient staging slot must hold at least {_SLOT_ALIGN} bytes")
        device = next(iter(params.values())).device  # (HostAdamW checked it is the only one)
        self.accumulator = torch.zeros(sum(n for _off, n, _shape in layout.values()), dtype=torch.float32)
        self.layout = layout
        self.slot_bytes = slot_bytes
        cuda = device.type == "cuda"
        self._slots = [torch.empty(slot_bytes, dtype=torch.uint8, pin_memory=cuda) for _ in range(slots)]
        self._stream: torch.cuda.Stream | None = torch.cuda.Stream(device) if cuda else None
        # One event per slot, re-recorded only once the host thread has given the slot back.
        # Blocking events: the host thread sleeps while a copy is on the bus instead of
        # spinning on a core the optimizer's threads could use.
        self._events = [torch.cuda.Event(blocking=True) for _ in range(slots)] if cuda else None
        self._free: queue.Queue[int] = queue.Queue()
        for k in range(slots):
            self._free.put(k)
        self._pending = _Pending()
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._hook(name, layout[name][0])) for name, p in params.items()
        ]

    @property
    def pending(self) -> int:
        """Slices handed over whose add has not finished yet."""
        return self._pending.count

    def _hook(self, name: str, offset: int) -> Callable[[torch.Tensor], None]:
        def hook(p: torch.Tensor) -> None:
            grad = p.grad
            assert grad is not None
            p.grad = None  # freed on the device once its copies are done (record_stream below)
            if not grad.is_contiguous():
                raise ValueError(f"gradient offload needs contiguous gradients ({name} is not)")
            self._hand_over(grad.view(-1), offset)

        return hook

    def _hand_over(self, flat: torch.Tensor, offset: int) -> None:
        """Queue `flat` (one parameter's gradient) for the accumulator from `offset` on, a
        slot's worth at a time, waiting for free slots as needed."""
        per_slot = self.slot_bytes // flat.element_size()
        stream = self._stream
        if stream is not None:
            # The gradient was written on backward's stream: the side stream's copies wait for
            # it; its memory must outlive them.
            stream.wait_stream(torch.cuda.current_stream(stream.device))
            flat.record_stream(stream)
        for start in range(0, flat.numel(), per_slot):
            count = min(per_slot, flat.numel() - start)
            slot = self._free.get()  # back-pressure: blocks while every slot is in flight
            src = self._slots[slot][: count * flat.element_size()].view(flat.dtype)
            event = None
            if stream is not None and self._events is not None:
                with torch.cuda.stream(stream):
                    src.copy_(flat[start : start + count], non_blocking=True)
                    event = self._events[slot]
                    event.record(stream)
            else:
                src.copy_(flat[start : start + count])
            self._pending.add()
            _host_thread().put(
                _Add(
                    slot,
                    src,
                    self.accumulator[offset + start : offset + start + count],
                    event,
                    self._free,
                    self._pending,
                )
            )

    def wait(self) -> None:
        """Return once every gradient handed over so far is in the accumulator. If the host
        thread failed, the accumulation is incomplete: it is zeroed and the failure raised."""
        self._pending.wait()
        if self._pending.failed:
            error = self._pending.failed[0]
            self._pending.failed.clear()
            self.accumulator.zero_()
            raise RuntimeError(
                f"gradient offload: adding a gradient into the host accumulator failed ({error!r}); this step's gradients were dropped"
            ) from error

    def zero(self) -> None:
        """Drop the accumulated gradients (after the pending adds, which would land later)."""
        try:
            self.wait()
        finally:
            self.accumulator.zero_()

    def sum_of_squares(self) -> float:
        self.wait()
        return host_sum_of_squares([self.accumulator[off : off + n] for off, n, _ in self.layout.values()])

    begin = wait  # before a step: every add issued by backward is in the accumulator

    def bucket(self, k: int, b: Bucket) -> torch.Tensor:
        return self.accumulator[b.start : b.end]


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

    def copy(
        self, pairs: list[tuple[torch.Tensor, torch.Tensor]], stream: "torch.cuda.Stream | None"
    ) -> torch.cuda.Event | None:
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


class DeviceGrads:
    """The gradients backward left in the parameters, fetched a bucket at a time: sum_of_squares() before
    a step, begin() and bucket(k, b) for each bucket in order during it, zero() after it, with
    the parameters' gradients dropped (GradOffload has the same four). `wide`: the gradient
    dtypes the masters' step reads itself; others are widened into fp32 first."""

    def __init__(
        self,
        params: Mapping[str, torch.nn.Parameter],
        buckets: list[Bucket],
        copier: Copier,
        wide: frozenset[torch.dtype],
    ):
        self.params, self.buckets, self.copier = params, buckets, copier
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

    def sum_of_squares(self) -> float:
        """Of the accumulated gradients (the gradient norm's square, before any reduction
        across ranks), in fp64 (host_sum_of_squares)."""
        grads = [local(p.grad) for p in self.params.values() if p.grad is not None]
        if grads and self.copier.cuda:
            norms = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float64) for g in grads])
            return float(norms.square().sum())
        return host_sum_of_squares(grads)

    def begin(self) -> None:
        self._fetched = self._fetch(0)

    def bucket(self, k: int, b: Bucket) -> torch.Tensor:
        """Bucket k's (b's) gradients on the host (fetching bucket k+1's meanwhile)."""
        next_fetch = self._fetch(k + 1) if k + 1 < len(self.buckets) else None
        self.copier.wait(self._fetched)
        self._fetched = next_fetch
        for name in self._last_in[k]:
            self.params[name].grad = None  # on the host now, in full
        grad = self._staging[k % 2][: b.size]
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

    def zero(self) -> None:
        """(Nothing held beside the parameters' own gradients.)"""


_NORM_CHUNK = 2**20  # elements widened to fp64 at a time (8 MiB of scratch)


def host_sum_of_squares(grads: list[torch.Tensor]) -> float:
    """Sum of squares of CPU tensors (DTensors: their local shards), in fp64. The square of a
    bf16 or fp32 value is exact in fp64, so only the fp64 additions round: a relative 1e-16,
    however the values are split into chunks, buckets or ranks (ranks.py: N ranks' sums add up
    to one process's to that rounding). torch's fp32 CPU reduction keeps one long accumulation
    per SIMD lane and is off by ~0.4% over 50M elements; so chunks are widened into fp64
    scratch and reduced by a dot product (BLAS: about as fast as the fp32 reduction's read)."""
    scratch = torch.empty(_NORM_CHUNK if grads else 0, dtype=torch.float64)
    total = 0.0
    for g in grads:
        values = local(g).reshape(-1)
        for start in range(0, values.numel(), _NORM_CHUNK):
            piece = values[start : start + _NORM_CHUNK]
            x = scratch[: piece.numel()].copy_(piece)
            total += float(torch.dot(x, x))
    return total
