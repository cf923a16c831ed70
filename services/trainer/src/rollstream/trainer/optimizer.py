"""AdamW with the fp32 master weights and moments in host memory, stepped in buckets.

The model on the compute device holds bf16-valued weights (in its compute dtype) and
accumulates gradients there; this optimizer holds the fp32 masters and the AdamW moments on
the CPU (moments optionally in bf16, half the memory) and runs torch's fused CPU AdamW.

Master layouts (`master_layout`); host bytes a parameter with fp32 / bf16 moments:
  split  12 / 8. Each fp32 master is kept as two 16-bit planes: `hi`, its bf16 rounding,
         which *is* the served weight (published, and what the model computes with), and
         `lo`, the low half of the fp32 bit pattern. With w the master's bits as an int32:
             hi = (w + 0x8000) >> 16      (bf16 rounding, ties away from zero)
             lo = w mod 2^16, as an int16
             w  = (hi << 16) + lo         (exact: w - (hi << 16) lies in [-2^15, 2^15))
         AdamW runs on the exact fp32 master, so the step is fp32-master AdamW bit for bit,
         and the served bits and the master are one buffer. A bucket is stepped in one pass
         by a compiled kernel (split_kernel.py: join, AdamW, split, old and new bits out),
         or, where it was not built, with torch operations (joined into fp32 scratch, torch's
         fused AdamW, split back): the same bits. The served rounding differs from torch's
         round-to-nearest-even only on exact ties (low half 0x8000, about one value in
         2^17): nearest-even cannot be inverted from 16 more bits (an even bf16 value has
         2^16 + 1 fp32 values rounding to it), ties-away can. So that version 0 is torch's
         rounding of the model all the same (what the reference service and a LoRA base
         compute with), a master read from the model that sits exactly on such a tie, with
         nearest-even rounding down, starts one fp32 ulp lower (2^-24 relative; a bf16
         checkpoint has no ties).
  fp32   16 / 12. An fp32 master vector, and the served bits twice: the version just made
         and the previous one (the base of the next delta).

Every parameter is flattened into one master vector (and one vector per moment), cut into
equal buckets of `bucket_mb` MB of fp32 masters. AdamW is elementwise, so a bucket may start
or end in the middle of a parameter. A step:
  1. the total gradient norm, on the compute device (the clip factor must be known before
     any bucket is updated);
  2. per bucket: the bucket's gradient slices go device-to-host into a pinned staging buffer
     on a side stream, the CPU scales them by the clip factor and runs fused AdamW on the
     bucket's masters and moments, rounds the result to bf16 into a second pinned buffer,
     which goes host-to-device into the parameters on another side stream; each piece of a
     parameter in the bucket is handed to `on_piece` (the publisher's delta encoder) with its
     bits before and after, so the delta is built on the way instead of by a pass over every
     tensor after the step, and the split layout keeps no copy of the previous version: the
     bucket's old bits are copied just before AdamW overwrites them. Staging buffers are
     double-buffered: while the CPU works on bucket k, the gradients of bucket k+1 come down
     and the weights of bucket k-1 go up.
On a CPU-only machine the same code runs with plain synchronous copies and no streams.

The overlapped update (step with `model`): the norm, the clip factor and the refusal of a
non-finite step are decided on the caller's thread, then step 2 runs on a thread of its own
and step() returns. The next forward goes on meanwhile: each module waits only for the
buckets of its own weights (in layout order, which is the forward's), the decoder's end for
all of them, and backward for the whole update, whose last act is dropping the gradients
(each parameter's device gradient goes as soon as the bucket with its last piece has come
down, so the next forward has the room).
So the step's wall time approaches max(forward + backward, optimizer) instead of their sum,
with the same buckets, in the same order, as the sequential step: the same bits. Why not
during the last backward instead (ZeRO-Offload's and LSRL's overlap): a bucket's AdamW
needs the clip factor, and the refusal needs every gradient finite, and both depend on the
last gradient backward makes (docs/design-notes.md, "The optimizer step overlapped with
the next forward").

Why the masters and moments are not pinned: they never cross the bus (only gradients and
bf16 weights do), and pinning 8-12 bytes per parameter of page-locked memory would be a
large, slow allocation for nothing; only the staging buffers are pinned.

Gradient offload (`grad_offload`, grad_offload.py): each parameter's gradient leaves the
device as soon as backward has produced it (a post-accumulate-grad hook), so the device never
holds the full gradient. It goes down in its own dtype (bf16) into a ring of pinned staging
slots on a side stream and is freed on the device once copied; a host thread adds it, widened
to fp32, into the host accumulator in the order the hooks fired (the bits of a synchronous
fp32 add), while backward goes on. A full ring makes the hook wait. The step, grad_norm and
discard_grads wait for the pending adds first. Host memory: 4 more bytes a parameter, and
4 staging slots of one bucket's fp32 size.

step() returns the bf16 bits of every parameter: they are what gets published, and the
model computes with exactly these values. In the split layout they are views of `hi`: they
change in place at the next step.
"""

from __future__ import annotations

import math
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch
from torch.optim.adamw import adamw as functional_adamw

from rollstream.core import progress
from rollstream.trainer import split_kernel as split_kernel_module
from rollstream.trainer.grad_offload import GradOffload
from rollstream.trainer.split_kernel import TORCH_VECTOR_WIDTH, AdamWStep

MomentsDtype = Literal["float32", "bfloat16"]
MasterLayout = Literal["split", "fp32"]
# Called for every piece of a parameter once its bucket is stepped, as
# on_piece(name, start, old, new): `start` is the piece's offset in the flattened parameter,
# `old` its bits before the step (the receiver may keep them) and `new` its bits now (a view
# that stays unchanged until the next step).
OnPiece = Callable[[str, int, np.ndarray, np.ndarray], None]
_MOMENT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def host_bytes_per_parameter(master_layout: MasterLayout, moments_dtype: MomentsDtype, grad_offload: bool = False) -> int:
    """What the layout holds a parameter in host memory (staging buffers and deltas aside)."""
    master = 4 if master_layout == "split" else 4 + 2 + 2  # fp32: the served bits, twice
    moments = 2 * (4 if moments_dtype == "float32" else 2)
    return master + moments + (4 if grad_offload else 0)
# Bucket boundaries on multiples of this many elements keep every bucket's vectors aligned
# for the fused kernel's SIMD loop.
_ALIGN = 64


@dataclass(frozen=True)
class Piece:
    """A contiguous run of one parameter's flattened elements inside one bucket."""

    name: str
    param_start: int  # offset in the flattened parameter
    bucket_start: int  # offset in the bucket
    count: int


@dataclass
class Bucket:
    start: int  # offset in the flat master vector
    end: int
    pieces: list[Piece] = field(default_factory=list)

    @property
    def size(self) -> int:
        return self.end - self.start


class _Copier:
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
        if self.cuda:
            torch.cuda.current_stream(self.h2d.device).wait_stream(self.h2d)


def _flat(t: torch.Tensor) -> torch.Tensor:
    if not t.is_contiguous():
        raise ValueError("HostAdamW needs contiguous parameters and gradients")
    return t.view(-1)


class NonFiniteStep(ArithmeticError):
    """A step whose loss or gradients are not finite: nothing was applied."""


@dataclass
class _InFlight:
    """An update running on the optimizer's worker thread (HostAdamW.step with `model`): when
    it ends, and per bucket whether its weights are on their way into the model (`uploaded`,
    set once the copy is issued; `copied`, the CUDA event of that copy, None on the CPU)."""

    done: Future[None]  # set by the worker thread
    uploaded: list[threading.Event]
    copied: list[torch.cuda.Event | None]
    failed: bool = False


class HostAdamW:
    def __init__(
        self,
        params: Mapping[str, torch.nn.Parameter],
        lr: float,
        betas: tuple[float, float],
        weight_decay: float,
        eps: float = 1e-8,
        *,
        bucket_mb: float = 32.0,
        moments_dtype: MomentsDtype = "float32",
        master_layout: MasterLayout = "split",
        grad_offload: bool = False,
        spare_bits: bool | None = None,
        split_kernel: bool | None = None,
    ):
        """`spare_bits` (fp32 layout): keep the bits buffer of two steps ago between steps for
        reuse (see _bits_buffer); None: only when the model is on a GPU. `split_kernel`
        (split layout): step with the compiled one-pass kernel (split_kernel.py); None: where
        it was built, False: with torch operations (the same bits, slower)."""
        self.params = dict(params)
        if not self.params:
            raise ValueError("HostAdamW needs at least one parameter")
        devices = {p.device for p in self.params.values()}
        if len(devices) != 1:
            raise ValueError(f"parameters live on several devices: {sorted(map(str, devices))}")
        if master_layout not in ("split", "fp32"):
            raise ValueError(f"master_layout must be 'split' or 'fp32', not {master_layout!r}")
        self.device = devices.pop()
        self.lr, self.betas, self.weight_decay, self.eps = lr, betas, weight_decay, eps
        self.moments_dtype = moments_dtype
        self.step_count = 0

        # The flat layout: name -> (offset, numel, shape).
        self.layout: dict[str, tuple[int, int, tuple[int, ...]]] = {}
        total = 0
        for name, p in self.params.items():
            self.layout[name] = (total, p.numel(), tuple(p.shape))
            total += p.numel()
        self.numel = total
        bucket_elems = max(_ALIGN, int(bucket_mb * 2**20) // 4 // _ALIGN * _ALIGN)
        self.buckets = self._cut(bucket_elems)
        width = max(b.size for b in self.buckets)

        # The masters: one fp32 vector, or the served bits (hi) and the low halves (lo).
        self.split = master_layout == "split"
        self.flat_master = torch.empty(0 if self.split else total, dtype=torch.float32)
        self.hi = torch.empty(total if self.split else 0, dtype=torch.int16)
        self.lo = torch.empty(total if self.split else 0, dtype=torch.int16)
        # Split layout: each bucket's fp32 masters are joined here for AdamW (int32 scratch
        # for the split back).
        self._master32 = torch.empty(width if self.split else 0, dtype=torch.float32)
        self._int32 = torch.empty(width if self.split else 0, dtype=torch.int32)
        with torch.no_grad():
            for b in self.buckets:  # bucket by bucket: no whole-parameter fp32 copy
                # The split layout's scratch (split below), or the fp32 layout's masters themselves.
                m32 = self._master32[: b.size] if self.split else self.flat_master[b.start : b.end]
                for pc in b.pieces:
                    src = _flat(self.params[pc.name].detach())[pc.param_start : pc.param_start + pc.count]
                    m32[pc.bucket_start : pc.bucket_start + pc.count].copy_(src)
                if self.split:
                    _nearest_even_ties_down(m32)
                    self._store_master(b.start, m32)
        moments = _MOMENT_DTYPES[moments_dtype]
        self.exp_avg = torch.zeros(total, dtype=moments)
        self.exp_avg_sq = torch.zeros(total, dtype=moments)

        pin = self.device.type == "cuda"
        # On a GPU gradients come down in the parameters' dtype (bf16: half the bytes over the
        # bus; fp32 when the dtypes are mixed, so that none loses precision) into pinned
        # staging, and the CPU widens them to fp32. On the CPU they are widened straight into
        # the fp32 staging: no second copy.
        dtypes = {p.dtype for p in self.params.values()}
        grad_dtype = dtypes.pop() if pin and len(dtypes) == 1 else torch.float32
        # Two of each, so that bucket k+1 (or k-1) can be in flight while the CPU works on k.
        self._grad_in = [torch.empty(width, dtype=grad_dtype, pin_memory=pin) for _ in range(2)]
        self._bf16_out = [torch.empty(width, dtype=torch.bfloat16, pin_memory=pin) for _ in range(2)]
        self._grad32 = torch.empty(width, dtype=torch.float32) if grad_dtype != torch.float32 else None
        if moments_dtype != "float32":
            self._m32 = torch.empty(width, dtype=torch.float32)
            self._v32 = torch.empty(width, dtype=torch.float32)
        self._copier = _Copier(self.device)
        self._kernel = split_kernel_module.load() if self.split and split_kernel is not False else None
        if split_kernel and self._kernel is None:
            raise RuntimeError("the split layout's compiled kernel was not built (services/trainer/setup.py needs a C compiler at install)")
        # Gradients that come down in bf16 or fp16 are widened into fp32 scratch, except bf16
        # ones for the kernel, which widens them as it reads them.
        self._widen_grads = self._grad32 is not None and not (self._kernel is not None and grad_dtype == torch.bfloat16)
        # Split layout: where a bucket's served bits before the step go when no delta wants them.
        self._old_scratch = np.empty(width if self.split else 0, dtype=np.uint16)
        # fp32 layout: the bits last written into the model, and a spare buffer (see _bits_buffer).
        self._bits = np.empty(0, dtype=np.uint16)
        self._spare_bits: np.ndarray | None = None
        self._keep_spare = self.device.type == "cuda" if spare_bits is None else spare_bits

        # Gradient offload: the hooks fill host_grad (grad_offload.py); wait for them before reading it.
        self._grad_offload = GradOffload(self.params, self.layout, slot_bytes=width * 4) if grad_offload else None
        self.host_grad = self._grad_offload.accumulator if self._grad_offload is not None else None

        # The update in flight (step with `model`) and its thread; the buckets each parameter
        # lies in, and the models whose forward waits for them (hooks made once per model).
        self._in_flight: _InFlight | None = None
        self._buckets_of: dict[str, list[int]] = {name: [] for name in self.params}
        for k, b in enumerate(self.buckets):
            for pc in b.pieces:
                self._buckets_of[pc.name].append(k)
        # The parameters whose last piece is in bucket k: their device gradients may go once
        # bucket k's have come down (an overlapped update's next forward needs the room).
        self._last_in: list[list[str]] = [[] for _ in self.buckets]
        for name, held in self._buckets_of.items():
            if held:  # (an empty parameter is in no bucket)
                self._last_in[held[-1]].append(name)
        self._gates: dict[int, list[torch.utils.hooks.RemovableHandle]] = {}

    # -- layout ----------------------------------------------------------------------

    def _cut(self, bucket_elems: int) -> list[Bucket]:
        buckets = [Bucket(start, min(start + bucket_elems, self.numel)) for start in range(0, self.numel, bucket_elems)]
        for name, (off, n, _shape) in self.layout.items():
            pos = off
            while pos < off + n:
                b = buckets[pos // bucket_elems]
                count = min(off + n, b.end) - pos
                b.pieces.append(Piece(name, pos - off, pos - b.start, count))
                pos += count
        return buckets

    # -- the masters ------------------------------------------------------------------

    def _load_master(self, start: int, end: int, out: torch.Tensor) -> torch.Tensor:
        """Split layout: the fp32 masters [start, end) joined from hi and lo into `out`."""
        return _join(self.hi[start:end], self.lo[start:end], out, self._int32[: end - start])

    def _store_master(self, start: int, m32: torch.Tensor) -> None:
        """Split layout: make `m32` the fp32 masters from `start` on (split into hi and lo)."""
        end = start + m32.numel()
        w = m32.view(torch.int32)
        self.lo[start:end].copy_(w)  # int32 -> int16 keeps the low half
        high = torch.add(w, 0x8000, out=self._int32[: m32.numel()])  # m32 is at most a bucket
        high.bitwise_right_shift_(16)
        self.hi[start:end].copy_(high)  # the high half of w + 0x8000: bf16 rounding, ties away

    @property
    def uses_split_kernel(self) -> bool:
        """Whether steps run the compiled one-pass kernel (split layout, where it was built)."""
        return self._kernel is not None

    @property
    def master(self) -> Mapping[str, torch.Tensor]:
        """The fp32 master of every parameter by name: views of the fp32 layout's vector, or
        (split layout) joined on each access, a copy."""
        return _Masters(self)

    def master_of(self, name: str) -> torch.Tensor:
        self.wait()
        off, n, shape = self.layout[name]
        if not self.split:
            return self.flat_master[off : off + n].view(shape)
        out = torch.empty(n, dtype=torch.float32)
        width = self._int32.numel()  # the scratch _load_master widens into
        for start in range(0, n, width):
            self._load_master(off + start, off + min(n, start + width), out[start : start + width])
        return out.view(shape)

    # -- published weights ------------------------------------------------------------

    def published_bits(self) -> dict[str, np.ndarray]:
        """The bf16 rounding of the masters: the weights the model computes with and
        publishes (split layout: views of hi, no copy)."""
        self.wait()
        if self.split:
            return self._split_bits(_bits_of(self.hi))
        out = np.empty(self.numel, dtype=np.uint16)
        for b in self.buckets:
            out[b.start : b.end] = _bits_of(self.flat_master[b.start : b.end].to(torch.bfloat16))
        return self._split_bits(out)

    def _split_bits(self, flat: np.ndarray) -> dict[str, np.ndarray]:
        return {name: flat[off : off + n].reshape(shape) for name, (off, n, shape) in self.layout.items()}

    @torch.no_grad()
    def sync_model(self) -> dict[str, np.ndarray]:
        """Write the served bits into the model's parameters; return those bits."""
        self.wait()
        self._copier.begin()
        return self._update_buckets(1.0, False, None, self._new_bits())

    # -- the update in flight -------------------------------------------------------------

    def wait(self) -> None:
        """Until the update in flight (step with `model`) is done: masters and moments final,
        the new weights in the model (the compute stream waits for their copies) and the
        gradients dropped. Raises the update's error, if it failed. Every method that reads
        or changes the optimizer's state calls it first; any thread may."""
        update = self._in_flight
        if update is not None:
            update.done.result()  # a failed update stays in flight: every wait raises its error
            self._copier.end()
            if self._in_flight is update:  # (not a newer one): the gating hooks then cost a read
                self._in_flight = None

    def _await_buckets(self, buckets: list[int]) -> None:
        """A forward pre-hook's wait: until these buckets' new weights are on their way into
        the model; on CUDA the compute stream then waits for their copies, not this thread."""
        update = self._in_flight
        if update is None:  # nothing in flight (the common case, every module of every forward)
            return
        if update.done.done():
            self.wait()
            return
        for k in buckets:
            update.uploaded[k].wait()
            copied = update.copied[k]
            if copied is not None:
                torch.cuda.current_stream(self.device).wait_event(copied)
        if update.failed:
            self.wait()  # raises the update's error

    def _gate(self, model: torch.nn.Module) -> None:
        """Make `model`'s forward wait, module by module, for the buckets of the trained
        parameters each module holds, and its decoder's end wait for the whole update (the
        LM head's weight is read outside any module call: modeling.head_logprobs). So the
        next forward runs while the update goes on, and uses no weight before it is final."""
        if id(model) in self._gates:
            return
        names = {id(p): name for name, p in self.params.items()}
        hooks = []
        for module in model.modules():
            held = sorted({k for p in module.parameters(recurse=False) if id(p) in names for k in self._buckets_of[names[id(p)]]})
            if held:
                hooks.append(module.register_forward_pre_hook(lambda _m, _args, held=held: self._await_buckets(held)))
        get_decoder = getattr(model, "get_decoder", None)
        if get_decoder is not None:
            hooks.append(get_decoder().register_forward_hook(lambda _m, _args, _out: self.wait()))
        self._gates[id(model)] = hooks

    # -- the step -----------------------------------------------------------------------

    def grad_norm(self) -> float:
        """Total 2-norm of the accumulated gradients (before clipping; also read by step.nonfinite_groups)."""
        self.wait()
        if self._grad_offload is not None:
            self._grad_offload.wait()
            grads = [self._grad_offload.accumulator[off : off + n] for off, n, _ in self.layout.values()]
        else:
            grads = [p.grad for p in self.params.values() if p.grad is not None]
        if not grads:
            return 0.0
        if self.host_grad is None and self.device.type == "cuda":
            # CUDA reductions are trees: fp32 accumulation is accurate enough.
            norms = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads])
            return float(torch.linalg.vector_norm(norms))
        scratch = torch.empty(_NORM_CHUNK, dtype=torch.float32)
        return math.sqrt(sum(_sum_of_squares(g, scratch) for g in grads))

    def discard_grads(self) -> None:
        """Drop the accumulated gradients without a step (a step refused for non-finite values)."""
        self.wait()
        self._drop_grads()

    def _drop_grads(self) -> None:
        for p in self.params.values():
            p.grad = None
        if self._grad_offload is not None:
            self._grad_offload.zero()

    @torch.no_grad()
    def step(self, max_grad_norm: float, on_piece: OnPiece | None = None, model: torch.nn.Module | None = None) -> tuple[float, dict[str, np.ndarray]]:
        """One AdamW step from the accumulated gradients (then cleared). Returns (grad norm
        before clipping, the new bf16 bits of every parameter); `on_piece` gets each piece
        of each parameter, old and new bits, during the step. A non-finite gradient norm
        applies nothing (and calls nothing): the gradients are dropped and NonFiniteStep is
        raised.

        With `model` (the one holding the parameters), the norm is taken and the buckets are
        stepped on a thread of their own after step() returns: the bits returned are final
        once wait() returns, `on_piece` is called from that thread, and the model's next
        forward runs meanwhile, each module waiting only for the buckets of its own weights
        (_gate); its backward waits for the whole update (step._accumulate). The same
        buckets in the same order: the same bits as without `model`."""
        norm = self.grad_norm()
        if not math.isfinite(norm):
            self.discard_grads()
            raise NonFiniteStep(f"gradient norm is {norm}")
        clip = 1.0
        if max_grad_norm > 0:
            # torch.nn.utils.clip_grad_norm_'s factor, computed as it does (fp32), so results match it.
            clip = float(torch.clamp(max_grad_norm / (torch.tensor(norm, dtype=torch.float32) + 1e-6), max=1.0))
        self.step_count += 1
        self._copier.begin()
        new_bits = self._new_bits()
        if model is None:
            self._update_buckets(clip, True, on_piece, new_bits)
            self._drop_grads()  # every fetch was waited for: the device memory may go
            return norm, self._split_bits(new_bits)
        self._gate(model)
        update = _InFlight(Future(), [threading.Event() for _ in self.buckets], [None] * len(self.buckets))
        self._in_flight = update
        threading.Thread(target=self._run_update, args=(update, clip, on_piece, new_bits), name="host-adamw").start()
        return norm, self._split_bits(new_bits)

    def _run_update(self, update: _InFlight, clip: float, on_piece: OnPiece | None, new_bits: np.ndarray) -> None:
        """step()'s buckets on the update's own thread; every bucket counts as uploaded once
        it ends, so that no forward waits forever for an update that failed (it raises)."""
        try:
            with torch.no_grad():  # thread-local: the step's no_grad is the caller's thread's
                self._update_buckets(clip, True, on_piece, new_bits, update)
                self._drop_grads()
        except BaseException as e:
            update.failed = True
            update.done.set_exception(e)
        else:
            update.done.set_result(None)
        finally:
            for uploaded in update.uploaded:
                uploaded.set()

    def _fetch(self, k: int) -> torch.cuda.Event | None:
        """Start bringing bucket k's gradients into the staging slot k % 2."""
        b, staging = self.buckets[k], self._grad_in[k % 2]
        pairs = []
        for pc in b.pieces:
            p = self.params[pc.name]
            dst = staging[pc.bucket_start : pc.bucket_start + pc.count]
            if p.grad is None:
                dst.zero_()  # a parameter outside the graph: zero gradient, as torch's AdamW with grads of 0
            else:
                pairs.append((_flat(p.grad)[pc.param_start : pc.param_start + pc.count], dst))
        return self._copier.copy(pairs, self._copier.d2h)

    def _bits_buffer(self) -> np.ndarray:
        """fp32 layout: where the new bits go. Steady state needs two buffers (the previous
        version stays the base of the publisher's next delta), and a fresh 2-bytes-per-parameter
        allocation every step costs its page faults (~1 s at 1.5B parameters), so the buffer of
        two steps ago is reused, but only while nothing holds a view of it any more (every
        numpy view keeps its base array referenced): bits handed out stay valid as long as
        anyone keeps them.
        Not on a CPU-only machine: there the spare would sit in host memory through forward
        and backward, beside the activations and gradients, which is where the trainer's
        host peak is (+257 MiB at 135M, benchmarks/trainer_memory.py); a fresh buffer costs
        ~0.03 s a step at that size. On a GPU the activations are not in host memory and the
        host peak is the step itself, which needs two buffers either way."""
        spare, self._spare_bits = self._spare_bits, None
        if spare is not None and sys.getrefcount(spare) == 2:  # `spare` and getrefcount's argument
            return spare
        return np.empty(self.numel, dtype=np.uint16)

    def _new_bits(self) -> np.ndarray:
        """Where a step's or a sync's bits go: hi itself (split layout) or a buffer."""
        return _bits_of(self.hi) if self.split else self._bits_buffer()

    def _update_buckets(self, clip: float, adam: bool, on_piece: OnPiece | None, new_bits: np.ndarray, update: _InFlight | None = None) -> dict[str, np.ndarray]:
        """Step (adam) or only copy out (sync_model) every bucket, writing the bits into
        `new_bits` and the model; with `update`, each bucket is marked once its copy into
        the model is issued."""
        old_bits = self._bits if not self.split and self._bits.size == self.numel else None
        if on_piece is not None and not self.split and old_bits is None:
            raise RuntimeError("no previous bits to encode a delta from: sync_model() or load_state() first")
        fetch_grads = adam and self.host_grad is None
        if adam and self._grad_offload is not None:
            self._grad_offload.wait()  # every add issued by backward is in host_grad
        fetched = self._fetch(0) if fetch_grads else None
        put: list[torch.cuda.Event | None] = [None, None]
        for k, b in enumerate(self.buckets):
            n = b.size
            # The H2D copy that last read this output slot (bucket k-2) must be done.
            self._copier.wait(put[k % 2])
            out = self._bf16_out[k % 2][:n]
            bucket_old = np.empty(0, dtype=np.uint16)
            if adam:
                if fetch_grads:
                    next_fetch = self._fetch(k + 1) if k + 1 < len(self.buckets) else None
                    self._copier.wait(fetched)
                    fetched = next_fetch
                    for name in self._last_in[k]:
                        self.params[name].grad = None  # on the host now, in full
                    grad = self._grad_in[k % 2][:n]
                    if self._widen_grads:
                        grad = self._grad32[:n].copy_(grad)
                else:
                    assert self.host_grad is not None
                    grad = self.host_grad[b.start : b.end]
                if self.split:
                    # The only copy of the previous version: this bucket's, about to be overwritten.
                    bucket_old = np.empty(n, dtype=np.uint16) if on_piece is not None else self._old_scratch[:n]
                    self._step_split_bucket(b, grad, clip, bucket_old, out)
                else:
                    if clip < 1.0:
                        grad.mul_(clip)
                    self._adamw(b.start, b.end, grad)
            if self.split and not adam:  # (a step wrote `out` above)
                out.view(torch.int16).copy_(self.hi[b.start : b.end])
            elif not self.split:
                out.copy_(self.flat_master[b.start : b.end])  # round to nearest even: the bf16 weights
                new_bits[b.start : b.end] = _bits_of(out)
            put[k % 2] = self._copier.copy(
                [(out[pc.bucket_start : pc.bucket_start + pc.count], _flat(self.params[pc.name])[pc.param_start : pc.param_start + pc.count]) for pc in b.pieces],
                self._copier.h2d,
            )
            if update is not None:
                update.copied[k] = put[k % 2]
                update.uploaded[k].set()
            if on_piece is not None and adam:
                for pc in b.pieces:
                    at = b.start + pc.bucket_start
                    old = bucket_old[pc.bucket_start : pc.bucket_start + pc.count] if old_bits is None else old_bits[at : at + pc.count]
                    on_piece(pc.name, pc.param_start, old, new_bits[at : at + pc.count])
        for event in put:
            self._copier.wait(event)
        self._copier.end()
        if not self.split:
            self._spare_bits = self._bits if self._keep_spare and self._bits.size == self.numel else None
            self._bits = new_bits
        return self._split_bits(new_bits)

    def _step_split_bucket(self, b: Bucket, grad: torch.Tensor, clip: float, old: np.ndarray, out: torch.Tensor) -> None:
        """Split layout: AdamW on bucket b's masters and moments, its served bits before the
        step into `old` and after it into `out`. The compiled kernel does what torch's fused
        kernel does with vector code, in one pass; the bucket's last n % 16 values (only the
        last bucket has any) go through torch, whose scalar code rounds them differently."""
        n, out16 = b.size, out.view(torch.int16)
        body = n - n % TORCH_VECTOR_WIDTH if self._kernel is not None else 0
        if body:
            at = slice(b.start, b.start + body)
            settings = AdamWStep(lr=self.lr, beta1=self.betas[0], beta2=self.betas[1], eps=self.eps, weight_decay=self.weight_decay, step=self.step_count, clip=clip)
            self._kernel.step(self.hi[at], self.lo[at], self.exp_avg[at], self.exp_avg_sq[at], grad[:body], old[:body], out16[:body], settings)
        if body < n:
            old[body:] = _bits_of(self.hi[b.start + body : b.end])
            rest = grad[body:] if grad.dtype == torch.float32 else self._grad32[body:n].copy_(grad[body:])
            if clip < 1.0:
                rest.mul_(clip)
            self._adamw(b.start + body, b.end, rest)
            out16[body:].copy_(self.hi[b.start + body : b.end])

    def _adamw(self, start: int, end: int, grad: torch.Tensor) -> None:
        """torch's fused AdamW on the masters and moments [start, end)."""
        n = end - start
        master = self._load_master(start, end, self._master32[:n]) if self.split else self.flat_master[start:end]
        m, v = self.exp_avg[start:end], self.exp_avg_sq[start:end]
        if self.moments_dtype != "float32":
            m32, v32 = self._m32[:n], self._v32[:n]
            m32.copy_(m)
            v32.copy_(v)
        else:
            m32, v32 = m, v
        # The functional form of torch.optim.AdamW(fused=True): it adds 1 to the step tensor
        # and runs the fused CPU kernel in place on master, m32, v32.
        step = torch.tensor(float(self.step_count - 1))
        functional_adamw(
            [master], [grad], [m32], [v32], [], [step],
            fused=True, amsgrad=False, beta1=self.betas[0], beta2=self.betas[1],
            lr=self.lr, weight_decay=self.weight_decay, eps=self.eps, maximize=False,
        )
        if self.moments_dtype != "float32":
            m.copy_(m32)
            v.copy_(v32)
        if self.split:
            self._store_master(start, master)

    # -- state (checkpoints) --------------------------------------------------------------

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Masters and moments by parameter name (views, no copies): master/<name> (fp32
        layout) or master_hi/<name> (bf16: the served weights) and master_lo/<name> (int16)
        (split layout), exp_avg/<name>, exp_avg_sq/<name>."""
        self.wait()
        out: dict[str, torch.Tensor] = {}
        for name, (off, n, shape) in self.layout.items():
            if self.split:
                out[f"master_hi/{name}"] = self.hi[off : off + n].view(torch.bfloat16).view(shape)
                out[f"master_lo/{name}"] = self.lo[off : off + n].view(shape)
            else:
                out[f"master/{name}"] = self.flat_master[off : off + n].view(shape)
            out[f"exp_avg/{name}"] = self.exp_avg[off : off + n].view(shape)
            out[f"exp_avg_sq/{name}"] = self.exp_avg_sq[off : off + n].view(shape)
        return out

    @torch.no_grad()
    def load_state(self, tensors: Mapping[str, torch.Tensor], step_count: int) -> dict[str, np.ndarray]:
        """Restore masters, moments and the step count (as saved by state_tensors, in either
        master layout: a checkpoint of the other one is converted exactly), write the served
        bits into the model, and return them."""
        self.wait()
        split_keys = {f"{kind}/{n}" for kind in ("master_hi", "master_lo", "exp_avg", "exp_avg_sq") for n in self.layout}
        fp32_keys = {f"{kind}/{n}" for kind in ("master", "exp_avg", "exp_avg_sq") for n in self.layout}
        saved_split = set(tensors) == split_keys
        if not saved_split and set(tensors) != fp32_keys:
            expected = split_keys if self.split else fp32_keys
            missing, extra = sorted(expected - set(tensors))[:3], sorted(set(tensors) - expected)[:3]
            raise ValueError(f"optimizer state does not match the parameters (missing {missing}, unexpected {extra})")
        moments = _MOMENT_DTYPES[self.moments_dtype]
        for name in progress.track(self.layout, "loading the optimizer state", total=len(self.layout)):
            off, n, shape = self.layout[name]
            if saved_split:
                hi = _checked(tensors, f"master_hi/{name}", torch.bfloat16, shape).view(torch.int16).reshape(-1)
                lo = _checked(tensors, f"master_lo/{name}", torch.int16, shape).reshape(-1)
                self._load_master_pieces(off, n, hi=hi, lo=lo)
            else:
                self._load_master_pieces(off, n, m32=_checked(tensors, f"master/{name}", torch.float32, shape).reshape(-1))
            self.exp_avg[off : off + n].copy_(_checked(tensors, f"exp_avg/{name}", moments, shape).reshape(-1))
            self.exp_avg_sq[off : off + n].copy_(_checked(tensors, f"exp_avg_sq/{name}", moments, shape).reshape(-1))
        self.step_count = step_count
        self._bits = np.empty(0, dtype=np.uint16)
        return self.sync_model()

    def _load_master_pieces(self, off: int, n: int, *, m32: torch.Tensor | None = None, hi: torch.Tensor | None = None, lo: torch.Tensor | None = None) -> None:
        """One parameter's saved masters into this layout, a bucket's width at a time."""
        if self.split and hi is not None and lo is not None:
            self.hi[off : off + n].copy_(hi)
            self.lo[off : off + n].copy_(lo)
            return
        width = self.buckets[0].size
        for start in range(0, n, width):
            end = min(n, start + width)
            if m32 is not None:
                chunk = m32[start:end]
            else:
                assert hi is not None and lo is not None
                chunk = _join(hi[start:end], lo[start:end], torch.empty(end - start), torch.empty(end - start, dtype=torch.int32))
            if self.split:
                self._store_master(off + start, self._master32[: end - start].copy_(chunk))
            else:
                self.flat_master[off + start : off + end].copy_(chunk)


def _join(hi: torch.Tensor, lo: torch.Tensor, out: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """The fp32 masters (hi << 16) + lo into `out` (fp32), with `scratch` (int32, as long)."""
    w = out.view(torch.int32)
    w.copy_(hi)  # sign-extended; those high bits are shifted out below
    w.bitwise_left_shift_(16)
    # The int16 low half, sign-extended: w - (hi << 16). Widened into scratch first: an
    # int32 += int16 add is ~3x slower than widening plus an int32 add (8M-element buckets
    # on 2 threads).
    w.add_(scratch.copy_(lo))
    return out


def _nearest_even_ties_down(m32: torch.Tensor) -> None:
    """In place: each fp32 value exactly halfway between two bf16 values whose lower
    neighbour is even (low half 0x8000, bit 16 clear) moves one ulp down, so that rounding
    ties away from zero gives what nearest-even gives for the original value."""
    w = m32.view(torch.int32)
    w.sub_(((w & 0x1FFFF) == 0x8000).to(torch.int32))  # a borrow never passes bit 15 here


def served_bits(master: torch.Tensor, master_layout: MasterLayout) -> np.ndarray:
    """The bf16 bits a layout serves for fp32 masters: round to nearest even (fp32 layout,
    torch's rounding) or ties away from zero (split layout; see the module's docstring)."""
    m = master.detach().to(device="cpu", dtype=torch.float32).contiguous()
    if master_layout == "fp32":
        return _bits_of(m.to(torch.bfloat16))
    high = m.view(torch.int32) + 0x8000
    return high.bitwise_right_shift_(16).to(torch.int16).numpy().view(np.uint16)


class _Masters(Mapping[str, torch.Tensor]):
    """HostAdamW.master: the fp32 masters by name, joined on access in the split layout."""

    def __init__(self, optimizer: HostAdamW):
        self._optimizer = optimizer

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._optimizer.layout:
            raise KeyError(name)
        return self._optimizer.master_of(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._optimizer.layout)

    def __len__(self) -> int:
        return len(self._optimizer.layout)


def _checked(tensors: Mapping[str, torch.Tensor], key: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    src = tensors[key]
    if tuple(src.shape) != tuple(shape) or src.dtype != dtype:
        raise ValueError(f"{key}: saved {src.dtype}{tuple(src.shape)}, expected {dtype}{tuple(shape)}")
    return src


_NORM_ROW = 4096
_NORM_CHUNK = 256 * _NORM_ROW  # elements widened to fp32 at a time (4 MiB of scratch)


def _sum_of_squares(t: torch.Tensor, scratch: torch.Tensor) -> float:
    """Sum of squares of a CPU tensor, accurately and fast. torch's fp32 CPU reduction keeps
    one long accumulation per SIMD lane and is off by ~0.4% over 50M elements; fp64 is exact
    but ~25x slower. So: rows of 4096 elements reduced in fp32 (short accumulations), the rows
    added up in fp64. Rows sit at fixed positions of the tensor, so the result depends only
    on the values (not on the dtype they come in, nor on any bucket size)."""
    flat = t.reshape(-1)
    total = 0.0
    for start in range(0, flat.numel(), _NORM_CHUNK):
        piece = flat[start : start + _NORM_CHUNK]
        x = piece if piece.dtype == torch.float32 else scratch[: piece.numel()].copy_(piece)
        full = x.numel() // _NORM_ROW * _NORM_ROW
        if full:
            rows = torch.linalg.vector_norm(x[:full].view(-1, _NORM_ROW), dim=1)
            total += float(rows.double().square().sum())
        if full < x.numel():
            total += float(torch.linalg.vector_norm(x[full:], dtype=torch.float64)) ** 2
    return total


def _bits_of(t: torch.Tensor) -> np.ndarray:
    """The uint16 bit patterns of a contiguous bf16 CPU tensor (a view, no copy)."""
    return t.view(torch.int16).numpy().view(np.uint16)
