"""The split master layout's one-pass AdamW (csrc/split_adamw.c), called through ctypes.

HostAdamW's split layout can step with torch operations alone: join each bucket's masters
into fp32 scratch, widen bf16 moments, run torch's fused AdamW, round the moments back,
split the masters, copy the served bits out: about thirteen passes over the bucket. The C
kernel does all of it in one pass, with the same arithmetic as torch's fused CPU kernel
(bit for bit: tests/unit/test_split_kernel.py): the step at 0.5B on 2 cores is 3x faster. It is built at
install time (services/trainer/setup.py) and optional: `load()` returns None where it was
not built, and the optimizer then runs the torch operations.

The kernel keeps no state and allocates nothing; a call is cut into ranges run on a thread
pool (ctypes releases the GIL during the call).
"""

from __future__ import annotations

import ctypes
import importlib.util
import logging
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

# torch's fused kernel steps whole vectors (16 fp32 lanes with AVX-512, 8 with AVX2) with its
# vector code and a call's last few values with scalar code, which rounds differently (no
# fused multiply-add). The kernel matches the vector code; the optimizer hands a bucket's last
# numel % 16 values to torch. They start on a multiple of 16, so torch splits them into vector
# and scalar code as it splits the whole bucket, with either width: both layouts round alike.
TORCH_VECTOR_WIDTH = 16
log = logging.getLogger(__name__)
_C_NAMES = {torch.bfloat16: "bf16", torch.float32: "f32"}
# Ranges handed to one thread are multiples of this many values (a cache line of fp32).
_ALIGN = 64


class _Hyper(ctypes.Structure):
    """adamw_params in csrc/split_adamw.c: the step's constants, rounded to fp32 as torch
    rounds them."""

    _fields_ = [
        ("clip", ctypes.c_float),
        ("decay", ctypes.c_float),
        ("lerp_coeff", ctypes.c_float),
        ("lerp_from_m", ctypes.c_int32),
        ("beta2", ctypes.c_float),
        ("sq_weight", ctypes.c_float),
        ("bc2_sqrt", ctypes.c_float),
        ("eps", ctypes.c_float),
        ("neg_step_size", ctypes.c_float),
    ]


@dataclass(frozen=True)
class AdamWStep:
    """One AdamW step's settings: torch.optim.AdamW's, plus the step number (from 1) and the
    gradient clipping factor."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    step: int
    clip: float = 1.0

    def hyper(self) -> _Hyper:
        """The constants as torch's fused kernel computes them: in double from the Python
        floats, then rounded to fp32 (ctypes.c_float rounds to nearest, as a C cast)."""
        step = float(self.step)  # torch reads the step tensor as a float
        bias_correction1 = 1 - self.beta1**step
        bias_correction2 = 1 - self.beta2**step
        lerp_weight = np.float32(1 - self.beta1)
        from_m = bool(abs(lerp_weight) < np.float32(0.5))
        return _Hyper(
            clip=self.clip,
            decay=1 - self.lr * self.weight_decay if self.weight_decay != 0 else 1.0,
            lerp_coeff=float(lerp_weight if from_m else lerp_weight - np.float32(1)),
            lerp_from_m=int(from_m),
            beta2=self.beta2,
            sq_weight=1 - self.beta2,
            bc2_sqrt=math.sqrt(bias_correction2),
            eps=self.eps,
            neg_step_size=-(self.lr / bias_correction1),
        )


class SplitKernel:
    """The compiled kernel and the threads that run it."""

    def __init__(self, lib: ctypes.CDLL, threads: int):
        # By (moments dtype, gradients dtype).
        self._functions = {
            (moments, grads): getattr(lib, f"split_adamw_m{_C_NAMES[moments]}_g{_C_NAMES[grads]}")
            for moments in _C_NAMES
            for grads in _C_NAMES
        }
        for fn in self._functions.values():
            fn.restype = None
            fn.argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_int64, ctypes.POINTER(_Hyper)]
        self.threads = max(1, threads)
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="split-adamw") if self.threads > 1 else None

    def step(
        self,
        hi: torch.Tensor,
        lo: torch.Tensor,
        exp_avg: torch.Tensor,
        exp_avg_sq: torch.Tensor,
        grad: torch.Tensor,
        old: np.ndarray,
        out: torch.Tensor,
        settings: AdamWStep,
    ) -> None:
        """In place on hi, lo (int16), exp_avg, exp_avg_sq (bf16 or fp32, one dtype); reads
        grad (fp32 or bf16); writes hi's bits before the step into `old` (uint16) and after it into
        `out` (16-bit). All contiguous, of one length."""
        n = hi.numel()
        tensors = (hi, lo, exp_avg, exp_avg_sq, grad, out)
        if (
            any(t.numel() != n or not t.is_contiguous() or t.device.type != "cpu" for t in tensors)
            or old.size != n
            or not old.flags.c_contiguous
        ):
            raise ValueError("split kernel: every buffer must be a contiguous CPU buffer of one length")
        fn = self._functions.get((exp_avg.dtype, grad.dtype))
        if (
            fn is None
            or (hi.dtype, lo.dtype, out.element_size(), old.dtype) != (torch.int16, torch.int16, 2, np.uint16)
            or exp_avg_sq.dtype != exp_avg.dtype
        ):
            raise ValueError("split kernel: wrong dtypes")
        hyper = settings.hyper()
        sizes = (2, 2, exp_avg.element_size(), exp_avg_sq.element_size(), grad.element_size(), 2, 2)
        bases = (
            hi.data_ptr(),
            lo.data_ptr(),
            exp_avg.data_ptr(),
            exp_avg_sq.data_ptr(),
            grad.data_ptr(),
            old.ctypes.data,
            out.data_ptr(),
        )

        def run(start: int, end: int) -> None:
            fn(*(base + start * size for base, size in zip(bases, sizes)), end - start, ctypes.byref(hyper))

        share = -(-n // self.threads // _ALIGN) * _ALIGN
        ranges = [(s, min(n, s + share)) for s in range(0, n, max(share, _ALIGN))]
        if self._pool is None or len(ranges) == 1:
            for start, end in ranges:
                run(start, end)
            return
        for future in [self._pool.submit(run, start, end) for start, end in ranges]:
            future.result()


def load(threads: int | None = None) -> SplitKernel | None:
    """The kernel, or None where it was not built (no C compiler at install time) or does not
    load here (built for another machine): the optimizer then runs torch operations, the same
    bits, slower."""
    spec = importlib.util.find_spec("rollstream.trainer._split_adamw")
    if spec is None or spec.origin is None:
        return None
    try:
        lib = ctypes.CDLL(spec.origin)
        return SplitKernel(lib, torch.get_num_threads() if threads is None else threads)
    except (OSError, AttributeError) as e:  # not loadable here, or built from an older source
        log.warning("split_kernel_unusable: %s (%s): stepping with torch operations", spec.origin, e)
        return None
