"""AdamW with the fp32 master weights and moments in host memory, stepped in buckets.

The model on the compute device holds bf16-valued weights (in its compute dtype) and
accumulates gradients there; this optimizer holds the fp32 masters and the AdamW moments on
the CPU (moments optionally in bf16, half the memory) and runs torch's fused CPU AdamW.

Layout: every parameter is flattened into one fp32 master vector (and one vector per
moment), cut into equal buckets of `bucket_mb` MB of masters. AdamW is elementwise, so a
bucket may start or end in the middle of a parameter. A step:
  1. the total gradient norm, on the compute device (the clip factor must be known before
     any bucket is updated);
  2. per bucket: the bucket's gradient slices go device-to-host into a pinned staging buffer
     on a side stream, the CPU scales them by the clip factor and runs fused AdamW on the
     bucket's masters and moments, rounds the result to bf16 into a second pinned buffer,
     which goes host-to-device into the parameters on another side stream; the bf16 bits of
     the bucket are copied into the new published bits, and each parameter whose last
     bucket this was is handed to `on_tensor` (the publisher's delta encoder) right away,
     so the delta is built on the way instead of by a pass over every tensor after the
     step. Staging buffers are double-buffered: while the CPU works on bucket k, the
     gradients of bucket k+1 come down and the weights of bucket k-1 go up.
On a CPU-only machine the same code runs with plain synchronous copies and no streams.

Why the masters and moments are not pinned: they never cross the bus (only gradients and
bf16 weights do), and pinning 12 bytes per parameter of page-locked memory would be a large,
slow allocation for nothing; only the staging buffers are pinned.

Gradient offload (`grad_offload`): each parameter's gradient is moved into an fp32 host
accumulator as soon as backward has produced it (a post-accumulate-grad hook) and freed on
the device, so the device never holds the full gradient; the step then reads the host
accumulator. The hook's copy is synchronous: it trades step time for device memory.

step() returns the bf16 bits of every parameter: they are what gets published, and the
model computes with exactly these values.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch
from torch.optim.adamw import adamw as functional_adamw

from rollstream.core import progress

MomentsDtype = Literal["float32", "bfloat16"]
# Called with a parameter's name and its new bf16 bits (final for this step) as soon as the
# last bucket holding it is done; the array stays valid and unchanged after the step.
OnTensor = Callable[[str, np.ndarray], None]
_MOMENT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
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

    def to_host(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.cuda.Event | None:
        """Copy each (device source -> host destination); returns an event to wait for."""
        return self._copy(pairs, self.d2h)

    def to_device(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.cuda.Event | None:
        """Copy each (host source -> device destination); returns an event to wait for."""
        return self._copy(pairs, self.h2d)

    def _copy(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], stream: "torch.cuda.Stream | None") -> torch.cuda.Event | None:
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
        grad_offload: bool = False,
        spare_bits: bool | None = None,
    ):
        """`spare_bits`: keep the bits buffer of two steps ago between steps for reuse (see
        _bits_buffer); None: only when the model is on a GPU."""
        self.params = dict(params)
        if not self.params:
            raise ValueError("HostAdamW needs at least one parameter")
        devices = {p.device for p in self.params.values()}
        if len(devices) != 1:
            raise ValueError(f"parameters live on several devices: {sorted(map(str, devices))}")
        self.device = devices.pop()
        self.lr, self.betas, self.weight_decay, self.eps = lr, betas, weight_decay, eps
        self.moments_dtype = moments_dtype
        self.grad_offload = grad_offload
        self.step_count = 0

        # The flat layout: name -> (offset, numel, shape).
        self.layout: dict[str, tuple[int, int, tuple[int, ...]]] = {}
        total = 0
        for name, p in self.params.items():
            self.layout[name] = (total, p.numel(), tuple(p.shape))
            total += p.numel()
        self.numel = total
        self.flat_master = torch.empty(total, dtype=torch.float32)
        self.master: dict[str, torch.Tensor] = {}
        for name, p in self.params.items():
            off, n, shape = self.layout[name]
            view = self.flat_master[off : off + n].view(shape)
            view.copy_(p.detach().to(device="cpu", dtype=torch.float32))
            self.master[name] = view
        moments = _MOMENT_DTYPES[moments_dtype]
        self.exp_avg = torch.zeros(total, dtype=moments)
        self.exp_avg_sq = torch.zeros(total, dtype=moments)

        bucket_elems = max(_ALIGN, int(bucket_mb * 2**20) // 4 // _ALIGN * _ALIGN)
        self.buckets = self._cut(bucket_elems)
        # The parameters whose last element is in bucket k: complete once k is stepped.
        self._completed_by: list[list[str]] = [[] for _ in self.buckets]
        for name, (off, n, _shape) in self.layout.items():
            self._completed_by[(off + n - 1) // bucket_elems].append(name)
        width = max(b.size for b in self.buckets)
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
        # The bits last written into the model, and a spare buffer (see _bits_buffer).
        self._bits = np.empty(0, dtype=np.uint16)
        self._spare_bits: np.ndarray | None = None
        self._keep_spare = self.device.type == "cuda" if spare_bits is None else spare_bits

        self.host_grad: torch.Tensor | None = None
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        if grad_offload:
            self.host_grad = torch.zeros(total, dtype=torch.float32)
            for name, p in self.params.items():
                self._hooks.append(p.register_post_accumulate_grad_hook(self._offload_hook(name)))

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

    def _offload_hook(self, name: str):
        off, n, _shape = self.layout[name]

        def hook(p: torch.Tensor) -> None:
            assert self.host_grad is not None and p.grad is not None
            self.host_grad[off : off + n].add_(_flat(p.grad).to(device="cpu", dtype=torch.float32))
            p.grad = None  # freed on the device: the host accumulator holds it now

        return hook

    # -- published weights ------------------------------------------------------------

    def published_bits(self) -> dict[str, np.ndarray]:
        """bf16 rounding of the masters: the weights the model computes with and publishes."""
        out = np.empty(self.numel, dtype=np.uint16)
        for b in self.buckets:
            out[b.start : b.end] = _bits_of(self.flat_master[b.start : b.end].to(torch.bfloat16))
        return self._split_bits(out)

    def _split_bits(self, flat: np.ndarray) -> dict[str, np.ndarray]:
        return {name: flat[off : off + n].reshape(shape) for name, (off, n, shape) in self.layout.items()}

    @torch.no_grad()
    def sync_model(self) -> dict[str, np.ndarray]:
        """Write bf16(master) into the model's parameters; return those bits."""
        self._copier.begin()
        return self._update_buckets(clip=1.0, adam=False)

    # -- the step -----------------------------------------------------------------------

    def grad_norm(self) -> float:
        """Total 2-norm of the accumulated gradients (before clipping; also read by step.nonfinite_groups)."""
        if self.host_grad is not None:
            grads = [self.host_grad[off : off + n] for off, n, _ in self.layout.values()]
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
        for p in self.params.values():
            p.grad = None
        if self.host_grad is not None:
            self.host_grad.zero_()

    @torch.no_grad()
    def step(self, max_grad_norm: float, on_tensor: OnTensor | None = None) -> tuple[float, dict[str, np.ndarray]]:
        """One AdamW step from the accumulated gradients (then cleared). Returns (grad norm
        before clipping, the new bf16 bits of every parameter); `on_tensor` gets each
        parameter's new bits during the step, as soon as they are final. A non-finite
        gradient norm applies nothing (and calls nothing): the gradients are dropped and
        NonFiniteStep is raised."""
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
        bits = self._update_buckets(clip=clip, adam=True, on_tensor=on_tensor)
        for p in self.params.values():
            p.grad = None  # every fetch was waited for: the device memory may go
        if self.host_grad is not None:
            self.host_grad.zero_()
        return norm, bits

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
        return self._copier.to_host(pairs)

    def _bits_buffer(self) -> np.ndarray:
        """Where the new bits go. Steady state needs two buffers (the previous version stays
        the base of the publisher's next delta), and a fresh 2-bytes-per-parameter allocation
        every step costs its page faults (~1 s at 1.5B parameters), so the buffer of two
        steps ago is reused, but only while nothing holds a view of it any more (every numpy
        view keeps its base array referenced): bits handed out stay valid as long as anyone
        keeps them.
        Not on a CPU-only machine: there the spare would sit in host memory through forward
        and backward, beside the activations and gradients, which is where the trainer's
        host peak is (+257 MiB at 135M, benchmarks/trainer_memory.py); a fresh buffer costs
        ~0.03 s a step at that size. On a GPU the activations are not in host memory and the
        host peak is the step itself, which needs two buffers either way."""
        spare, self._spare_bits = self._spare_bits, None
        if spare is not None and sys.getrefcount(spare) == 2:  # `spare` and getrefcount's argument
            return spare
        return np.empty(self.numel, dtype=np.uint16)

    def _update_buckets(self, clip: float, adam: bool, on_tensor: OnTensor | None = None) -> dict[str, np.ndarray]:
        new_bits = self._bits_buffer()
        fetch_grads = adam and self.host_grad is None
        fetched = self._fetch(0) if fetch_grads else None
        put: list[torch.cuda.Event | None] = [None, None]
        for k, b in enumerate(self.buckets):
            n = b.size
            if adam:
                if fetch_grads:
                    next_fetch = self._fetch(k + 1) if k + 1 < len(self.buckets) else None
                    self._copier.wait(fetched)
                    fetched = next_fetch
                    grad = self._grad_in[k % 2][:n]
                    if self._grad32 is not None:
                        grad = self._grad32[:n].copy_(grad)
                else:
                    assert self.host_grad is not None
                    grad = self.host_grad[b.start : b.end]
                if clip < 1.0:
                    grad.mul_(clip)
                self._adamw_bucket(b, grad)
            # The H2D copy that last read this output slot (bucket k-2) must be done.
            self._copier.wait(put[k % 2])
            out = self._bf16_out[k % 2][:n]
            out.copy_(self.flat_master[b.start : b.end])  # round to nearest even: the bf16 weights
            put[k % 2] = self._copier.to_device(
                [(out[pc.bucket_start : pc.bucket_start + pc.count], _flat(self.params[pc.name])[pc.param_start : pc.param_start + pc.count]) for pc in b.pieces]
            )
            new_bits[b.start : b.end] = _bits_of(out)
            if on_tensor is not None:
                for name in self._completed_by[k]:
                    off, count, shape = self.layout[name]
                    on_tensor(name, new_bits[off : off + count].reshape(shape))
        for event in put:
            self._copier.wait(event)
        self._copier.end()
        self._spare_bits = self._bits if self._keep_spare and self._bits.size == self.numel else None
        self._bits = new_bits
        return self._split_bits(new_bits)

    def _adamw_bucket(self, b: Bucket, grad: torch.Tensor) -> None:
        n = b.size
        master = self.flat_master[b.start : b.end]
        m, v = self.exp_avg[b.start : b.end], self.exp_avg_sq[b.start : b.end]
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

    # -- state (checkpoints) --------------------------------------------------------------

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Masters and moments by parameter name (views, no copies): master/<name>,
        exp_avg/<name>, exp_avg_sq/<name>."""
        out: dict[str, torch.Tensor] = {}
        for name, (off, n, shape) in self.layout.items():
            out[f"master/{name}"] = self.master[name]
            out[f"exp_avg/{name}"] = self.exp_avg[off : off + n].view(shape)
            out[f"exp_avg_sq/{name}"] = self.exp_avg_sq[off : off + n].view(shape)
        return out

    @torch.no_grad()
    def load_state(self, tensors: Mapping[str, torch.Tensor], step_count: int) -> dict[str, np.ndarray]:
        """Restore masters, moments and the step count (as saved by state_tensors), write
        bf16(master) into the model, and return those bits."""
        expected = set(self.state_tensors())
        if set(tensors) != expected:
            missing, extra = sorted(expected - set(tensors))[:3], sorted(set(tensors) - expected)[:3]
            raise ValueError(f"optimizer state does not match the parameters (missing {missing}, unexpected {extra})")
        targets = self.state_tensors()
        for key, dst in progress.track(targets.items(), "loading the optimizer state", total=len(targets)):
            src = tensors[key]
            if tuple(src.shape) != tuple(dst.shape) or src.dtype != dst.dtype:
                raise ValueError(f"{key}: saved {src.dtype}{tuple(src.shape)}, expected {dst.dtype}{tuple(dst.shape)}")
            dst.copy_(src)
        self.step_count = step_count
        self._bits = np.empty(0, dtype=np.uint16)
        return self.sync_model()


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
