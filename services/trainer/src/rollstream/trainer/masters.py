"""HostAdamW's state in host memory (optimizer.py): the flat layout cut into buckets, the
AdamW moments (fp32, or bf16: half the memory) and the fp32 masters in one of two layouts,
each chosen once, when the optimizer is made; the step, the checkpoint and the published
bits call these objects instead of branching on the options.

Master layouts (`master_layout`); host bytes a parameter with fp32 / bf16 moments:
  split  12 / 8. An fp32 master as two 16-bit planes, `hi` (its bf16 rounding: the served
         weight, so the served bits and the master are one buffer) and `lo` (the low half of
         its bit pattern). With w the master's bits as an int32:
             hi = (w + 0x8000) >> 16      (bf16 rounding, ties away from zero)
             lo = w mod 2^16, as an int16
             w  = (hi << 16) + lo         (exact: w - (hi << 16) lies in [-2^15, 2^15))
         AdamW runs on the exact fp32 master (fp32-master AdamW bit for bit), in one pass of
         a compiled kernel (split_kernel.py) or, where it was not built, with torch
         operations: the same bits. Ties round away from zero, not to nearest even (about
         one value in 2^17: nearest-even cannot be inverted from 16 more bits), so a master
         read from the model on a tie that nearest-even rounds down starts one fp32 ulp
         lower: version 0 is torch's rounding of the model all the same. docs/design-notes.md,
         "Masters as served bits plus a remainder".
  fp32   16 / 12. An fp32 master vector, and the served bits twice: the version just made
         and the previous one (the base of the next delta).
         In the model (ModelMasters, `in_model`): the fp32 vector is a float32 CPU model's own
         parameters, stepped in place; nothing is served, so 0 bytes beyond the model's
         (SFT's float32 run, which has no generator: sft.py).
The masters and moments are not pinned: they never cross the bus (gradients and bf16 weights
do, through pinned staging), and pinning 8-12 bytes a parameter would be a large, slow
allocation for nothing.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch
from torch.distributed.tensor import DTensor
from torch.optim.adamw import adamw as functional_adamw

from rollstream.trainer import split_kernel as split_kernel_module
from rollstream.trainer.split_kernel import TORCH_VECTOR_WIDTH, AdamWStep, SplitKernel

MomentsDtype = Literal["float32", "bfloat16"]
MasterLayout = Literal["split", "fp32"]
Layout = dict[str, tuple[int, int, tuple[int, ...]]]  # name -> (offset, numel, shape) in the flat vectors
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


def cut(params: Mapping[str, torch.nn.Parameter], bucket_mb: float) -> tuple[Layout, list[Bucket]]:
    """The flat layout and its buckets of `bucket_mb` MB of fp32 masters (optimizer.py), over
    the parameters' local shards where they are DTensors."""
    layout: Layout = {}
    total = 0
    for name, p in params.items():
        shard = local(p)
        layout[name] = (total, shard.numel(), tuple(shard.shape))
        total += shard.numel()
    size = max(_ALIGN, int(bucket_mb * 2**20) // 4 // _ALIGN * _ALIGN)
    buckets = [Bucket(start, min(start + size, total)) for start in range(0, total, size)]
    for name, (off, n, _shape) in layout.items():
        pos = off
        while pos < off + n:
            b = buckets[pos // size]
            count = min(off + n, b.end) - pos
            b.pieces.append(Piece(name, pos - off, pos - b.start, count))
            pos += count
    return layout, buckets


def buckets_of(params: Mapping[str, torch.nn.Parameter], buckets: list[Bucket]) -> dict[str, list[int]]:
    """The buckets each parameter lies in, in order (none for an empty parameter)."""
    held: dict[str, list[int]] = {name: [] for name in params}
    for k, b in enumerate(buckets):
        for pc in b.pieces:
            held[pc.name].append(k)
    return held


def one_device(params: Mapping[str, torch.nn.Parameter]) -> torch.device:
    """The one device all of `params` live on."""
    devices = {p.device for p in params.values()}
    if not devices:
        raise ValueError("HostAdamW needs at least one parameter")
    if len(devices) > 1:
        raise ValueError(f"parameters live on several devices: {sorted(map(str, devices))}")
    return devices.pop()


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard, a view of the storage FSDP2 all-gathers from (ranks.py: a rank's
    HostAdamW steps the shards it holds); any other tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def flat(t: torch.Tensor) -> torch.Tensor:
    """`t` (a DTensor: its local shard) as a flat view."""
    t = local(t)
    if not t.is_contiguous():
        raise ValueError("HostAdamW needs contiguous parameters and gradients")
    return t.view(-1)


def host_bytes_per_parameter(
    master_layout: MasterLayout, moments_dtype: MomentsDtype, grad_offload: bool = False
) -> int:
    """What the layout holds a parameter in host memory (staging buffers and deltas aside)."""
    moments = 2 * _MOMENT_DTYPES[moments_dtype].itemsize
    return _LAYOUTS[master_layout].bytes_per_parameter + moments + (4 if grad_offload else 0)


def checked(tensors: Mapping[str, torch.Tensor], key: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A saved tensor of the dtype and shape expected, flattened."""
    src = tensors[key]
    if tuple(src.shape) != tuple(shape) or src.dtype != dtype:
        raise ValueError(f"{key}: saved {src.dtype}{tuple(src.shape)}, expected {dtype}{tuple(shape)}")
    return src.reshape(-1)


class Moments:
    """The AdamW moments, fp32 or bf16; bf16 ones are widened into fp32 scratch for torch's
    fused AdamW (one dtype for all its tensors) and rounded back."""

    kinds = ("exp_avg", "exp_avg_sq")

    def __init__(self, numel: int, dtype: MomentsDtype, width: int):
        self.dtype = _MOMENT_DTYPES[dtype]
        self.exp_avg = torch.zeros(numel, dtype=self.dtype)
        self.exp_avg_sq = torch.zeros(numel, dtype=self.dtype)
        self.tensors = dict(zip(self.kinds, (self.exp_avg, self.exp_avg_sq)))  # as checkpoints hold them
        self._wide = None if self.dtype == torch.float32 else (torch.empty(width), torch.empty(width))

    def adamw(self, master: torch.Tensor, grad: torch.Tensor, start: int, s: AdamWStep) -> None:
        """torch's fused AdamW on `master` (fp32), the masters from `start` on, and their
        moments, with `grad` (fp32, scaled in place by the clip factor)."""
        if s.clip < 1.0:
            grad.mul_(s.clip)
        n = master.numel()
        m, v = self.exp_avg[start : start + n], self.exp_avg_sq[start : start + n]
        m32, v32 = (self._wide[0][:n].copy_(m), self._wide[1][:n].copy_(v)) if self._wide else (m, v)
        # The functional form of torch.optim.AdamW(fused=True): it adds 1 to the step tensor
        # and runs the fused CPU kernel in place on master, m32, v32.
        step = torch.tensor(float(s.step - 1))
        functional_adamw(
            [master],
            [grad],
            [m32],
            [v32],
            [],
            [step],
            fused=True,
            amsgrad=False,
            beta1=s.beta1,
            beta2=s.beta2,
            lr=s.lr,
            weight_decay=s.weight_decay,
            eps=s.eps,
            maximize=False,
        )
        if self._wide:
            m.copy_(m32)
            v.copy_(v32)


def _read_bucket(b: Bucket, params: Mapping[str, torch.nn.Parameter], out: torch.Tensor) -> torch.Tensor:
    """Bucket b's values in the model, into `out` (fp32): bucket by bucket, no whole-model fp32 copy."""
    for pc in b.pieces:
        out[pc.bucket_start : pc.bucket_start + pc.count].copy_(
            flat(params[pc.name].detach())[pc.param_start : pc.param_start + pc.count]
        )
    return out


class _Layout:
    """What a master layout holds (hi, lo: split; flat: fp32; the others' empty) and does:
    fill from the model, step or copy out a bucket, convert the other layout's checkpoint."""

    name: MasterLayout
    kinds: tuple[str, ...]  # its tensors in a checkpoint, as <kind>/<parameter name>
    tensors: dict[str, torch.Tensor]  # by kind, flat, as checkpoints hold them
    grad_dtypes = frozenset({torch.float32})  # the gradient dtypes step_bucket reads (others come widened)
    serves = True  # whether a step makes bf16 bits (written into the model, returned, published by deltas)

    def __init__(self, width: int, moments: Moments):
        self.hi = self.lo = torch.empty(0, dtype=torch.int16)
        self.flat, self.width, self.moments = torch.empty(0), width, moments

    def begin(self, delta: bool) -> None:
        """Before a step (`delta`: its old bits are wanted) or a sync."""

    def end(self, new_bits: np.ndarray) -> None:
        """After it: `new_bits` are served."""


class SplitMasters(_Layout):
    """The split layout: hi (the served bits) and lo, joined into fp32 a bucket at a time."""

    name: MasterLayout = "split"
    kinds = ("master_hi", "master_lo")
    bytes_per_parameter = 4

    def __init__(self, numel: int, width: int, moments: Moments, kernel: SplitKernel | None):
        super().__init__(width, moments)
        self.hi, self.lo = torch.empty(numel, dtype=torch.int16), torch.empty(numel, dtype=torch.int16)
        self.kernel = kernel
        self.tensors = dict(zip(self.kinds, (self.hi.view(torch.bfloat16), self.lo)))
        if kernel is not None:  # it widens bf16 gradients as it reads them
            self.grad_dtypes = frozenset({torch.float32, torch.bfloat16})
        # A bucket's fp32 masters are joined here for AdamW (int32 scratch for the split back).
        self._master32, self._int32 = torch.empty(width), torch.empty(width, dtype=torch.int32)
        # Where a bucket's served bits before the step go when no delta wants them.
        self._old_scratch = np.empty(width, dtype=np.uint16)

    def fill(self, buckets: list[Bucket], params: Mapping[str, torch.nn.Parameter]) -> None:
        for b in buckets:
            m32 = _read_bucket(b, params, self._master32[: b.size])
            _nearest_even_ties_down(m32)
            self._store(b.start, m32)

    def _load(self, start: int, end: int, out: torch.Tensor) -> torch.Tensor:
        """The fp32 masters [start, end) joined from hi and lo into `out`."""
        return _join(self.hi[start:end], self.lo[start:end], out, self._int32[: end - start])

    def _store(self, start: int, m32: torch.Tensor) -> None:
        """Make `m32` (at most a bucket) the fp32 masters from `start` on (split into hi and lo)."""
        end = start + m32.numel()
        w = m32.view(torch.int32)
        self.lo[start:end].copy_(w)  # int32 -> int16 keeps the low half
        high = torch.add(w, 0x8000, out=self._int32[: m32.numel()])
        high.bitwise_right_shift_(16)
        self.hi[start:end].copy_(high)  # the high half of w + 0x8000: bf16 rounding, ties away

    def master(self, off: int, n: int) -> torch.Tensor:
        out = torch.empty(n, dtype=torch.float32)
        for start in range(0, n, self.width):
            self._load(off + start, off + min(n, start + self.width), out[start : start + self.width])
        return out

    def new_bits(self) -> np.ndarray:
        return bits_of(self.hi)  # the step writes hi itself

    published = new_bits

    def step_bucket(
        self, b: Bucket, grad: torch.Tensor, s: AdamWStep, out: torch.Tensor, new_bits: np.ndarray, keep_old: bool
    ) -> np.ndarray:
        """AdamW on bucket b's masters and moments, its served bits after the step into `out`;
        returns those before it (kept only with `keep_old`). The compiled kernel does what torch's
        fused kernel does with vector code, in one pass; the bucket's last n % 16 values (only
        the last bucket has any) go through torch, whose scalar code rounds them differently."""
        n, out16 = b.size, out.view(torch.int16)
        old = np.empty(n, dtype=np.uint16) if keep_old else self._old_scratch[:n]
        body = n - n % TORCH_VECTOR_WIDTH if self.kernel is not None else 0
        if self.kernel is not None and body:
            at = slice(b.start, b.start + body)
            m = self.moments
            self.kernel.step(
                self.hi[at], self.lo[at], m.exp_avg[at], m.exp_avg_sq[at], grad[:body], old[:body], out16[:body], s
            )
        if body < n:
            old[body:] = bits_of(self.hi[b.start + body : b.end])
            master = self._load(b.start + body, b.end, self._master32[: n - body])
            self.moments.adamw(master, grad[body:].float(), b.start + body, s)
            self._store(b.start + body, master)
            out16[body:].copy_(self.hi[b.start + body : b.end])
        return old

    def copy_out(self, b: Bucket, out: torch.Tensor, new_bits: np.ndarray) -> None:
        out.view(torch.int16).copy_(self.hi[b.start : b.end])

    def convert(self, tensors: Mapping[str, torch.Tensor], name: str, off: int, n: int, shape: tuple[int, ...]) -> None:
        """One parameter's masters from an fp32-layout checkpoint, exactly."""
        m32 = checked(tensors, f"master/{name}", torch.float32, shape)
        for start in range(0, n, self.width):
            chunk = m32[start : start + self.width]
            self._store(off + start, self._master32[: chunk.numel()].copy_(chunk))


class Fp32Masters(_Layout):
    """The fp32 layout: the masters as one fp32 vector; the bits last served kept beside it."""

    name: MasterLayout = "fp32"
    kinds = ("master",)
    bytes_per_parameter = 4 + 2 + 2  # the served bits, twice

    def __init__(self, numel: int, width: int, moments: Moments, keep_spare: bool):
        super().__init__(width, moments)
        self.flat = torch.empty(numel)
        self.tensors = {"master": self.flat}
        # The bits last written into the model, and a spare buffer (see new_bits).
        self.bits = np.empty(0, dtype=np.uint16)
        self._spare: np.ndarray | None = None
        self._keep_spare = keep_spare

    def fill(self, buckets: list[Bucket], params: Mapping[str, torch.nn.Parameter]) -> None:
        for b in buckets:
            _read_bucket(b, params, self.flat[b.start : b.end])

    def master(self, off: int, n: int) -> torch.Tensor:
        return self.flat[off : off + n]

    def published(self) -> np.ndarray:
        out = np.empty(self.flat.numel(), dtype=np.uint16)
        for start in range(0, self.flat.numel(), self.width):
            out[start : start + self.width] = bits_of(self.flat[start : start + self.width].to(torch.bfloat16))
        return out

    def new_bits(self) -> np.ndarray:
        """Where the new bits go: the buffer of two steps ago (a fresh one costs its page faults,
        ~1 s at 1.5B), kept only with spare_bits (on a GPU: docs/design-notes.md, "No spare bits
        buffer without a GPU") and reused only while nothing holds a view of it (every numpy
        view keeps its base referenced): bits handed out stay valid as long as anyone keeps them."""
        spare, self._spare = self._spare, None
        if spare is not None and sys.getrefcount(spare) == 2:  # `spare` and getrefcount's argument
            return spare
        return np.empty(self.flat.numel(), dtype=np.uint16)

    def begin(self, delta: bool) -> None:
        if delta and self.bits.size != self.flat.numel():
            raise RuntimeError("no previous bits to encode a delta from: sync_model() or load_state() first")

    def step_bucket(
        self, b: Bucket, grad: torch.Tensor, s: AdamWStep, out: torch.Tensor, new_bits: np.ndarray, keep_old: bool
    ) -> np.ndarray:
        self.moments.adamw(self.flat[b.start : b.end], grad, b.start, s)
        self.copy_out(b, out, new_bits)
        return self.bits[b.start : b.end]

    def copy_out(self, b: Bucket, out: torch.Tensor, new_bits: np.ndarray) -> None:
        out.copy_(self.flat[b.start : b.end])  # round to nearest even: the bf16 weights
        new_bits[b.start : b.end] = bits_of(out)

    def end(self, new_bits: np.ndarray) -> None:
        self._spare = self.bits if self._keep_spare and self.bits.size == self.flat.numel() else None
        self.bits = new_bits

    def convert(self, tensors: Mapping[str, torch.Tensor], name: str, off: int, n: int, shape: tuple[int, ...]) -> None:
        """One parameter's masters from a split-layout checkpoint, exactly."""
        hi = checked(tensors, f"master_hi/{name}", torch.bfloat16, shape).view(torch.int16)
        lo = checked(tensors, f"master_lo/{name}", torch.int16, shape)
        scratch = torch.empty(min(n, self.width), dtype=torch.int32)
        for start in range(0, n, self.width):
            end = min(n, start + self.width)
            _join(hi[start:end], lo[start:end], self.flat[off + start : off + end], scratch[: end - start])


class ModelMasters(Fp32Masters):
    """The fp32 layout whose vector is the model: fill() makes each float32 CPU parameter a view
    of it, so a step changes the weights the model computes with, in place, and serves no bits
    (no copy into the model, no bf16 bits built). Its checkpoints are the fp32 layout's."""

    serves = False

    def __init__(self, numel: int, width: int, moments: Moments):
        super().__init__(numel, width, moments, keep_spare=False)
        self._no_bits = np.empty(0, dtype=np.uint16)

    def fill(self, buckets: list[Bucket], params: Mapping[str, torch.nn.Parameter]) -> None:
        bad = sorted(f"{n} ({p.dtype}, {p.device})" for n, p in params.items() if p.dtype != torch.float32 or p.is_cuda)
        if bad:
            raise ValueError(f"masters in the model need float32 CPU parameters, not {', '.join(bad[:3])}")
        super().fill(buckets, params)
        for b in buckets:
            for pc in b.pieces:
                if pc.param_start == 0:  # a parameter's first piece: it starts here in the vector
                    p, off = params[pc.name], b.start + pc.bucket_start
                    p.data = self.flat[off : off + p.numel()].view(p.shape)

    def new_bits(self) -> np.ndarray:
        return self._no_bits

    def begin(self, delta: bool) -> None:
        if delta:
            raise RuntimeError("masters in the model serve no bits to encode a delta from")

    def step_bucket(
        self, b: Bucket, grad: torch.Tensor, s: AdamWStep, out: torch.Tensor, new_bits: np.ndarray, keep_old: bool
    ) -> np.ndarray:
        self.moments.adamw(self.flat[b.start : b.end], grad, b.start, s)
        return self._no_bits

    def copy_out(self, b: Bucket, out: torch.Tensor, new_bits: np.ndarray) -> None:
        """Nothing: the model holds the masters."""

    def end(self, new_bits: np.ndarray) -> None:
        """Nothing: no bits were served."""


Masters = SplitMasters | Fp32Masters
_LAYOUTS: dict[MasterLayout, type[Masters]] = {"split": SplitMasters, "fp32": Fp32Masters}


def saved_layout(keys: set[str], names: Iterable[str], ours: MasterLayout) -> MasterLayout:
    """The layout a checkpoint's tensors were saved in (either is loaded, converted exactly)."""
    expected = {
        layout: {f"{kind}/{n}" for kind in (*cls.kinds, *Moments.kinds) for n in names}
        for layout, cls in _LAYOUTS.items()
    }
    for layout, wanted in expected.items():
        if keys == wanted:
            return layout
    missing, extra = sorted(expected[ours] - keys)[:3], sorted(keys - expected[ours])[:3]
    raise ValueError(f"optimizer state does not match the parameters (missing {missing}, unexpected {extra})")


def make_masters(
    layout: MasterLayout,
    width: int,
    moments: Moments,
    device: torch.device,
    spare_bits: bool | None,
    kernel: bool | None,
    in_model: bool = False,
) -> Masters:
    """The layout's masters, as many as the moments. `spare_bits` (fp32): keep the bits buffer of
    two steps ago for reuse (Fp32Masters.new_bits); None: only on a GPU. `kernel` (split): step
    with the compiled kernel; None: where it was built, False: with torch operations (the same bits).
    `in_model` (fp32): the model's parameters are the masters (ModelMasters)."""
    if layout not in _LAYOUTS:
        raise ValueError(f"master_layout must be 'split' or 'fp32', not {layout!r}")
    if in_model:
        if layout != "fp32":
            raise ValueError(f"masters in the model are the fp32 layout, not {layout!r}")
        return ModelMasters(moments.exp_avg.numel(), width, moments)
    numel, split = (
        moments.exp_avg.numel(),
        split_kernel_module.load() if layout == "split" and kernel is not False else None,
    )
    if kernel and split is None:
        raise RuntimeError("the split layout's compiled kernel was not built (setup.py needs a C compiler at install)")
    if layout == "split":
        return SplitMasters(numel, width, moments, split)
    return Fp32Masters(numel, width, moments, device.type == "cuda" if spare_bits is None else spare_bits)


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
        return bits_of(m.to(torch.bfloat16))
    high = m.view(torch.int32) + 0x8000
    return high.bitwise_right_shift_(16).to(torch.int16).numpy().view(np.uint16)


def bits_of(t: torch.Tensor) -> np.ndarray:
    """The uint16 bit patterns of a contiguous bf16 CPU tensor (a view, no copy)."""
    return t.view(torch.int16).numpy().view(np.uint16)
