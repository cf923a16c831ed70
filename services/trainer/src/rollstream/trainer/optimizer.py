"""AdamW with the fp32 master weights and moments in host memory, stepped in buckets.

The model on the compute device holds bf16-valued weights (in its compute dtype) and
accumulates gradients there; this optimizer holds the fp32 masters and the AdamW moments on
the CPU (moments optionally in bf16, half the memory) and runs torch's fused CPU AdamW.

Each option (master layout, moments dtype, compiled kernel, where the gradients come from)
is chosen once, when the optimizer is made, into a small object: masters.py (the layouts and
moments), staging.py (the copier; gradients on the device or offloaded). Here: the step over
the buckets, the update in flight, checkpoints.

Every parameter is flattened into one master vector (and one vector per moment), cut into
equal buckets of `bucket_mb` MB of fp32 masters. AdamW is elementwise, so a bucket may start
or end in the middle of a parameter. A step:
  1. the total gradient norm, on the compute device (the clip factor must be known before
     any bucket is updated);
  2. per bucket: the bucket's gradient slices go device-to-host into a pinned staging buffer
     on a side stream, the CPU scales them by the clip factor and runs fused AdamW on the
     bucket's masters and moments, rounds the result to bf16 into a second pinned buffer,
     which goes host-to-device into the parameters on another side stream; each piece of a
     parameter in the bucket goes to `on_piece` (the publisher's delta encoder) with its bits
     before and after: the delta is built on the way. Staging buffers are double-buffered:
     while the CPU works on bucket k, the gradients of k+1 come down and the weights of k-1 go up.
On a CPU-only machine the same code runs with plain synchronous copies and no streams.

The overlapped update (step with `model`): the norm, the clip factor and the refusal of a
non-finite step are decided on the caller's thread, then step 2 runs on a thread of its own
and step() returns. The next forward goes on meanwhile: each module waits only for the
buckets of its own weights, the decoder's end for all of them, and backward for the whole
update (docs/design-notes.md, "The optimizer step overlapped with the next forward"): the
same buckets, in the same order, as the sequential step, so the same bits.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np
import torch

from rollstream.core import progress
from rollstream.trainer import masters
from rollstream.trainer.masters import MasterLayout, Moments, MomentsDtype, host_bytes_per_parameter, served_bits
from rollstream.trainer.split_kernel import AdamWStep
from rollstream.trainer.staging import Copier, DeviceGrads, GradOffload

__all__ = [
    "HostAdamW",
    "MasterLayout",
    "MomentsDtype",
    "NonFiniteStep",
    "OnPiece",
    "host_bytes_per_parameter",
    "served_bits",
]
# Called for every piece of a parameter once its bucket is stepped, as
# on_piece(name, start, old, new): `start` is the piece's offset in the flattened parameter,
# `old` its bits before the step (the receiver may keep them) and `new` its bits now (a view
# that stays unchanged until the next step).
OnPiece = Callable[[str, int, np.ndarray, np.ndarray], None]


_FP32_MAX = torch.finfo(torch.float32).max


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
        moments_dtype: MomentsDtype,
        bucket_mb: float = 32.0,
        master_layout: MasterLayout = "split",
        grad_offload: bool = False,
        spare_bits: bool | None = None,
        split_kernel: bool | None = None,
        in_model: bool = False,
        reduce: Callable[[float], float] | None = None,
    ):
        """`moments_dtype` has no default: the trainer's settings hold it (TrainerSettings).
        `spare_bits`, `split_kernel`: masters.make_masters. `in_model` (fp32 layout, float32
        parameters on the CPU): the parameters become views of the masters' vector and a step
        changes them in place, with no bf16 bits made (masters.ModelMasters: SFT's float32 run);
        step() and sync_model() then return no bits. `params` may be DTensors (ranks.py): the
        optimizer then holds and steps their local shards, and `reduce` sums the gradient's sum
        of squares over the ranks (the norm and its clip factor are the whole model's)."""
        self.params = dict(params)
        self._reduce = reduce
        self.device = masters.one_device(self.params)
        self.lr, self.betas, self.weight_decay, self.eps, self.step_count = lr, betas, weight_decay, eps, 0
        self.layout, self.buckets = masters.cut(self.params, bucket_mb)
        self.numel, width = sum(n for _off, n, _shape in self.layout.values()), max(b.size for b in self.buckets)
        self.moments = Moments(self.numel, moments_dtype, width)
        self.masters = masters.make_masters(
            master_layout, width, self.moments, self.device, spare_bits, split_kernel, in_model
        )
        self.masters.fill(self.buckets, self.params)
        self.hi, self.lo, self.flat_master = self.masters.hi, self.masters.lo, self.masters.flat
        self.exp_avg, self.exp_avg_sq = self.moments.exp_avg, self.moments.exp_avg_sq
        self._copier = Copier(self.device)
        # Gradient offload: the hooks fill host_grad (staging.GradOffload); the step waits for them.
        offload = GradOffload(self.params, self.layout, slot_bytes=width * 4) if grad_offload else None
        self.grads = offload or DeviceGrads(self.params, self.buckets, self._copier, self.masters.grad_dtypes)
        self._grad_offload, self.host_grad = offload, offload.accumulator if offload is not None else None
        # Two, so that bucket k-1's weights can go up while the CPU works on bucket k.
        self._bf16_out = [torch.empty(width, dtype=torch.bfloat16, pin_memory=self._copier.cuda) for _ in range(2)]
        # The update in flight (step with `model`), the buckets each parameter lies in, the models gated.
        self._in_flight: _InFlight | None = None
        self._buckets_of = masters.buckets_of(self.params, self.buckets)
        self._gates: dict[int, list[torch.utils.hooks.RemovableHandle]] = {}

    @property
    def uses_split_kernel(self) -> bool:
        """Whether steps run the compiled one-pass kernel (split layout, where it was built)."""
        return getattr(self.masters, "kernel", None) is not None

    @property
    def master(self) -> Mapping[str, torch.Tensor]:
        """The fp32 master of every parameter by name: views of the fp32 layout's vector, or
        (split layout) joined on each access, a copy."""
        return _MasterView(self)

    # -- published weights ------------------------------------------------------------

    def published_bits(self) -> dict[str, np.ndarray]:
        """The bf16 rounding of the masters: the weights the model computes with and
        publishes (split layout: views of hi, no copy)."""
        self.wait()
        return self._split_bits(self.masters.published())

    def _split_bits(self, flat: np.ndarray) -> dict[str, np.ndarray]:
        return {name: flat[off : off + n].reshape(shape) for name, (off, n, shape) in self.layout.items()}

    def _served(self, new_bits: np.ndarray) -> dict[str, np.ndarray]:
        """A step's (or sync's) bits by parameter; none where the masters are the model."""
        return self._split_bits(new_bits) if self.masters.serves else {}

    @torch.no_grad()
    def sync_model(self) -> dict[str, np.ndarray]:
        """Write the served bits into the model's parameters; return those bits."""
        self.wait()
        self._copier.begin()
        return self._update_buckets(None, None, self.masters.new_bits())

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
            held = sorted(
                {k for p in module.parameters(recurse=False) if id(p) in names for k in self._buckets_of[names[id(p)]]}
            )
            if held:
                hooks.append(module.register_forward_pre_hook(lambda _m, _args, held=held: self._await_buckets(held)))
        get_decoder = getattr(model, "get_decoder", None)
        if get_decoder is not None:
            hooks.append(get_decoder().register_forward_hook(lambda _m, _args, _out: self.wait()))
        self._gates[id(model)] = hooks

    # -- the step -----------------------------------------------------------------------

    def grad_norm(self) -> float:
        """Total 2-norm of the accumulated gradients (before clipping; also read by
        step.nonfinite_groups), in fp32 as torch.nn.utils.clip_grad_norm_'s is: the squares are
        summed in fp64 (staging.host_sum_of_squares), and a sum past fp32's range is inf, as it
        is for torch (a gradient that large is refused, not clipped to a direction it alone sets)."""
        self.wait()
        squares = self.grads.sum_of_squares()
        if self._reduce is not None:
            squares = self._reduce(squares)
        if squares > _FP32_MAX:
            return math.inf
        return float(torch.tensor(math.sqrt(squares), dtype=torch.float32))

    def discard_grads(self) -> None:
        """Drop the accumulated gradients without a step (a step refused for non-finite values)."""
        self.wait()
        self._drop_grads()

    def _drop_grads(self) -> None:
        for p in self.params.values():
            p.grad = None
        self.grads.zero()

    @torch.no_grad()
    def step(
        self, max_grad_norm: float, on_piece: OnPiece | None = None, model: torch.nn.Module | None = None
    ) -> tuple[float, dict[str, np.ndarray]]:
        """One AdamW step from the accumulated gradients (then cleared). Returns (grad norm
        before clipping, the new bf16 bits of every parameter: what is published and what the
        model computes with; split layout: views of hi, changed in place by the next step);
        `on_piece` gets each piece of each parameter, old and new bits, during the step. A
        non-finite gradient norm applies nothing (and calls nothing): the gradients are dropped
        and NonFiniteStep is raised. With `model` (the one holding the parameters) the buckets
        are stepped on a thread of their own after step() returns (the module's docstring):
        the bits returned are final once wait() returns, `on_piece` is called from that thread,
        the model's modules wait for their buckets (_gate), backward for all (step._accumulate)."""
        norm = self.grad_norm()
        if not math.isfinite(norm):
            self.discard_grads()
            raise NonFiniteStep(f"gradient norm is {norm}")
        clip = 1.0
        if max_grad_norm > 0:
            # torch.nn.utils.clip_grad_norm_'s factor, computed as it does (fp32), so results match it.
            clip = float(torch.clamp(max_grad_norm / (torch.tensor(norm, dtype=torch.float32) + 1e-6), max=1.0))
        self.step_count += 1
        s = AdamWStep(self.lr, self.betas[0], self.betas[1], self.eps, self.weight_decay, self.step_count, clip)
        self._copier.begin()
        new_bits = self.masters.new_bits()
        if model is None:
            self._update_buckets(s, on_piece, new_bits)
            self._drop_grads()  # every fetch was waited for: the device memory may go
            return norm, self._served(new_bits)
        self._gate(model)
        update = _InFlight(Future(), [threading.Event() for _ in self.buckets], [None] * len(self.buckets))
        self._in_flight = update
        threading.Thread(target=self._run_update, args=(update, s, on_piece, new_bits), name="host-adamw").start()
        return norm, self._served(new_bits)

    def _run_update(self, update: _InFlight, s: AdamWStep, on_piece: OnPiece | None, new_bits: np.ndarray) -> None:
        """step()'s buckets on the update's own thread; every bucket counts as uploaded once
        it ends, so that no forward waits forever for an update that failed (it raises)."""
        try:
            with torch.no_grad():  # thread-local: the step's no_grad is the caller's thread's
                self._update_buckets(s, on_piece, new_bits, update)
                self._drop_grads()
        except BaseException as e:  # noqa: BLE001 - raised to the waiter on the caller's thread (done's exception)
            update.failed = True
            update.done.set_exception(e)
        else:
            update.done.set_result(None)
        finally:
            for uploaded in update.uploaded:
                uploaded.set()

    def _update_buckets(
        self, s: AdamWStep | None, on_piece: OnPiece | None, new_bits: np.ndarray, update: _InFlight | None = None
    ) -> dict[str, np.ndarray]:
        """Step with `s` or only copy out (None: sync_model) every bucket, writing the bits into
        `new_bits` and the model; with `update`, each bucket is marked once its copy into the
        model is issued."""
        self.masters.begin(delta=on_piece is not None)
        if s is not None:
            self.grads.begin()
        put: list[torch.cuda.Event | None] = [None, None]
        for k, b in enumerate(self.buckets):
            # The H2D copy that last read this output slot (bucket k-2) must be done.
            self._copier.wait(put[k % 2])
            out = self._bf16_out[k % 2][: b.size]
            if s is None:
                self.masters.copy_out(b, out, new_bits)
            else:
                old = self.masters.step_bucket(
                    b, self.grads.bucket(k, b), s, out, new_bits, keep_old=on_piece is not None
                )
            pairs = [
                (
                    out[pc.bucket_start : pc.bucket_start + pc.count],
                    masters.flat(self.params[pc.name])[pc.param_start : pc.param_start + pc.count],
                )
                for pc in b.pieces
                if self.masters.serves  # (else the step wrote the model itself)
            ]
            put[k % 2] = self._copier.copy(pairs, self._copier.h2d)
            if update is not None:
                update.copied[k] = put[k % 2]
                update.uploaded[k].set()
            if on_piece is not None:  # (only a step has one)
                for pc in b.pieces:
                    at = b.start + pc.bucket_start
                    on_piece(
                        pc.name,
                        pc.param_start,
                        old[pc.bucket_start : pc.bucket_start + pc.count],
                        new_bits[at : at + pc.count],
                    )
        for event in put:
            self._copier.wait(event)
        self._copier.end()
        self.masters.end(new_bits)
        return self._served(new_bits)

    # -- state (checkpoints) --------------------------------------------------------------

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Masters and moments by parameter name (views, no copies): master/<name> (fp32
        layout) or master_hi/<name> (bf16: the served weights) and master_lo/<name> (int16)
        (split layout), exp_avg/<name>, exp_avg_sq/<name>."""
        self.wait()
        held = self.masters.tensors | self.moments.tensors
        return {
            f"{kind}/{name}": t[off : off + n].view(shape)
            for name, (off, n, shape) in self.layout.items()
            for kind, t in held.items()
        }

    @torch.no_grad()
    def load_state(self, tensors: Mapping[str, torch.Tensor], step_count: int) -> dict[str, np.ndarray]:
        """Restore masters, moments and the step count (as saved by state_tensors, in either
        master layout: a checkpoint of the other one is converted exactly), write the served
        bits into the model, and return them."""
        self.wait()
        same = masters.saved_layout(set(tensors), self.layout, self.masters.name) == self.masters.name
        copied = (self.masters.tensors if same else {}) | self.moments.tensors  # (else converted)
        for name in progress.track(self.layout, "loading the optimizer state", total=len(self.layout)):
            off, n, shape = self.layout[name]
            if not same:
                self.masters.convert(tensors, name, off, n, shape)
            for kind, t in copied.items():
                t[off : off + n].copy_(masters.checked(tensors, f"{kind}/{name}", t.dtype, shape))
        self.step_count = step_count
        return self.sync_model()


class _MasterView(Mapping[str, torch.Tensor]):
    """HostAdamW.master: the fp32 masters by name, joined on access in the split layout."""

    def __init__(self, optimizer: HostAdamW):
        self._optimizer = optimizer

    def __getitem__(self, name: str) -> torch.Tensor:
        off, n, shape = self._optimizer.layout[name]  # (KeyError: not a parameter)
        self._optimizer.wait()
        return self._optimizer.masters.master(off, n).view(shape)

    def __iter__(self) -> Iterator[str]:
        return iter(self._optimizer.layout)

    def __len__(self) -> int:
        return len(self._optimizer.layout)
