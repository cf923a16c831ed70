"""Gradient offload: each parameter's gradient leaves the device as soon as backward has
produced it and is added into an fp32 host accumulator, off backward's critical path.

A post-accumulate-grad hook hands the gradient over in its own dtype (bf16: half the bytes
of fp32 over the bus) in slices of at most one staging slot. On a GPU a slice is copied
into a pinned slot on a side stream (non_blocking, an event recorded after it), and the
gradient is freed on the device as the hook returns: record_stream tells the caching
allocator not to reuse its memory before the side stream's copies are done. A host thread
waits for each slice's event, adds it (widened to fp32, exactly) into the accumulator and
gives the slot back. Slices are queued in the order the hooks fired and one thread takes
them in that order, so every accumulator element gets the same fp32 adds in the same order
as a synchronous `accumulator += grad.float()` in the hook: the same bits.

The staging ring is a fixed number of slots allocated once; when every slot is in flight
the hook waits for one (back-pressure): host memory stays bounded whatever backward does.
On a CPU-only machine the same code runs with plain copies and no events, still through
the ring and the host thread.

wait() is the barrier: the optimizer's step, gradient norm and discard call it before they
read or clear the accumulator. An exception in the host thread is kept and raised by the
next wait(), after the accumulation it broke has been dropped (zeroed): the step that would
have used it applies nothing.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

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
    when the parameters are on a GPU)."""

    def __init__(self, params: Mapping[str, torch.nn.Parameter], layout: Mapping[str, tuple[int, int, tuple[int, ...]]], *, slot_bytes: int, slots: int = 4):
        if slots < 1:
            raise ValueError(f"gradient offload needs at least one staging slot, not {slots}")
        slot_bytes = slot_bytes // _SLOT_ALIGN * _SLOT_ALIGN
        if slot_bytes < _SLOT_ALIGN:
            raise ValueError(f"a gradient staging slot must hold at least {_SLOT_ALIGN} bytes")
        devices = {p.device for p in params.values()}
        if len(devices) != 1:
            raise ValueError(f"parameters live on several devices: {sorted(map(str, devices))}")
        device = devices.pop()
        self.accumulator = torch.zeros(sum(n for _off, n, _shape in layout.values()), dtype=torch.float32)
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
        self._hooks = [p.register_post_accumulate_grad_hook(self._hook(name, layout[name][0])) for name, p in params.items()]

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
            _host_thread().put(_Add(slot, src, self.accumulator[offset + start : offset + start + count], event, self._free, self._pending))

    def wait(self) -> None:
        """Return once every gradient handed over so far is in the accumulator. If the host
        thread failed, the accumulation is incomplete: it is zeroed and the failure raised."""
        self._pending.wait()
        if self._pending.failed:
            error = self._pending.failed[0]
            self._pending.failed.clear()
            self.accumulator.zero_()
            raise RuntimeError(f"gradient offload: adding a gradient into the host accumulator failed ({error!r}); this step's gradients were dropped") from error

    def zero(self) -> None:
        """Drop the accumulated gradients (after the pending adds, which would land later)."""
        try:
            self.wait()
        finally:
            self.accumulator.zero_()
