"""The trainer as N ranks under torchrun: the model sharded with FSDP2, each rank's HostAdamW
over its own shard, and the few collectives the step and the service need on top.

A step on N ranks gives the bits of a step in one process (docs/design.md, "The trainer on N
ranks"), because every sum that crosses ranks is taken in the order one process takes it:
  - micro-batches: rank r runs micro-batch k*N + r in round k; a rank left without one in the
    last round runs a copy of the round's first, whose gradient is not added (`live`);
  - gradients: RankOrderedReduceScatter replaces FSDP's reduce-scatter. Each rank sends every
    other rank the slice of its micro-batch's gradient that rank owns (all_to_all), and the
    owner adds the slices onto the step's running sum in rank order: micro-batch 0, 1, 2, ...,
    the in-place `grad += g` sequence of one process's backward passes, in the gradients' dtype;
  - the gradient norm: each rank's sum of squares in fp64, all-reduced (HostAdamW `reduce`);
    only the fp64 rounding of that sum depends on the split (a relative 1e-16), and the clip
    factor is then rounded to fp32;
  - the finite check: each micro-batch's loss is agreed on (any rank's non-finite loss stops
    every rank before its backward, as one process stops), and the metrics are summed.
The optimizer is elementwise, so each rank's AdamW over its shard is the one process's AdamW
over those elements. Rank 0 alone talks to Redis, gRPC and the generators: it sends each step's
groups to the others (`Ranks.lead`/`follow`: JSON and protobuf bytes over broadcast) and
gathers their new bits (`full_bits`) into the one payload it publishes.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import struct
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NoReturn

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard

# FSDP2's comm hook interface (set_custom_reduce_scatter) is importable only from here in torch 2.13.
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
from torch.distributed.tensor import DTensor

from rollstream.core import modeling
from rollstream.v1 import rollout_pb2

if TYPE_CHECKING:
    from rollstream.trainer.config import TrainerSettings

# A follower waits in a broadcast for rank 0's next command while rank 0 waits for rollouts,
# which may take as long as the generators need: the collectives' timeout is not a health
# check (torchrun ends every rank when one dies).
_IDLE_TIMEOUT = datetime.timedelta(days=7)


@dataclass(frozen=True)
class World:
    """This process's place among torchrun's ranks (its environment)."""

    rank: int
    size: int
    local_rank: int

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> World | None:
        """The world torchrun started this process in; None when not started by torchrun (a
        WORLD_SIZE left in the environment by something else does not make a rank)."""
        if "TORCHELASTIC_RUN_ID" not in env:
            return None
        try:
            world = cls(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", "0")))
        except (KeyError, ValueError) as e:
            raise ValueError(f"torchrun's environment is incomplete or malformed: {e!r}") from e
        if not 0 <= world.rank < world.size:
            raise ValueError(f"RANK={world.rank} is outside WORLD_SIZE={world.size}")
        return world


def rank_device(device: str, world: World) -> str:
    """The device a rank computes on: its own GPU (cuda:LOCAL_RANK) when `device` is cuda."""
    if device == "cuda":
        return f"cuda:{world.local_rank}"
    if device.startswith("cuda:") and world.size > 1:
        raise ValueError(f"device = {device!r} names one GPU; N ranks take device = 'cuda' (one GPU a rank)")
    return device


class RankOrderedReduceScatter(ReduceScatter):
    """FSDP2's reduce-scatter of one parameter group's gradients, summed in rank order onto
    the step's running sum (the module's docstring). FSDP2 adds what this returns onto the
    shard's gradient, so `Ranks.before_round` clears those gradients: the running sum is the
    gradient. Only the first `live` ranks' slices are added (the others ran a padding copy)."""

    def __init__(self, ranks: Ranks):
        self.ranks = ranks
        self.running: torch.Tensor | None = None

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any,
        async_op: bool = False,
    ) -> dist.Work | None:
        received = torch.empty_like(input_tensor)
        dist.all_to_all_single(received, input_tensor, group=group)  # slice j of rank j's gradient, j = 0..N-1
        width = output_tensor.numel()
        for j in range(self.ranks.live):
            piece = received[j * width : (j + 1) * width]
            if self.running is None:
                self.running = piece.clone()  # a first backward assigns the gradient, as autograd does
            else:
                self.running += piece
        if self.running is None:  # (no live rank: not reached, round 0 has rank 0)
            output_tensor.zero_()
        else:
            output_tensor.copy_(self.running)
        return None


@dataclass
class Ranks:
    """The process group, the model's FSDP2 shards and the collectives on top of them."""

    world: World
    device: torch.device
    root: torch.nn.Module | None = None  # the FSDP root: _Forward around the model
    comms: list[RankOrderedReduceScatter] = field(default_factory=list)
    live: int = 1  # ranks with a real micro-batch in the current round

    @classmethod
    def from_env(cls, settings: TrainerSettings) -> Ranks | None:
        """The trainer's ranks when torchrun started this process (None otherwise), joined.
        What is not built on N ranks is refused here, naming the setting."""
        world = World.from_env()
        if world is None:
            return None
        refused = {
            "lora_rank": "LoRA" if settings.lora_rank else "",
            "grad_offload": "gradient offload" if settings.grad_offload else "",
        }
        for name, what in refused.items():
            if what:
                raise SystemExit(f"{name}: {what} on N ranks (torchrun) is not built; run the trainer as one process")
        return cls.join(world, rank_device(settings.device, world))

    @classmethod
    def join(cls, world: World, device: str) -> Ranks:
        """Join torchrun's process group (gloo on the CPU, NCCL on GPUs)."""
        dev = torch.device(device)
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        backend = "cpu:gloo,cuda:nccl" if dev.type == "cuda" else "gloo"
        dist.init_process_group(
            backend,
            rank=world.rank,
            world_size=world.size,
            timeout=_IDLE_TIMEOUT,
            device_id=dev if dev.type == "cuda" else None,
        )
        return cls(world, dev)

    @property
    def lead_rank(self) -> bool:
        return self.world.rank == 0

    # -- the model --------------------------------------------------------------------

    def shard(self, model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
        """Shard `model` with FSDP2: each decoder layer a unit, the rest (embeddings, final
        norm, LM head) in the root, a _Forward around the model, so that the step's forward
        (modeling.completion_logprobs, which calls the decoder and the head apart) runs inside
        the root's hooks. Returns the trained parameters by the model's names: DTensors, each
        rank holding its dim-0 slice (HostAdamW steps their local shards)."""
        mesh = init_device_mesh(self.device.type, (self.world.size,))
        layers = model.get_decoder().layers  # type: ignore[operator]  # nn.Module's __getattr__ hides transformers' method
        units: list[torch.nn.Module] = [*layers]
        root = _Forward(model)
        for unit in [*units, root]:
            fully_shard(unit, mesh=mesh)
        for unit in [*units, root]:
            assert isinstance(unit, FSDPModule)
            # Sums, not means: the loss is normalised over the whole step already (grpo.normaliser).
            # (One rank: FSDP2 divides by nothing then, and a factor of 1 would still cost a
            # division's copy of every gradient.)
            unit.set_force_sum_reduction_for_comms(True)
            if self.world.size > 1:
                unit.set_gradient_divide_factor(1.0)
                comm = RankOrderedReduceScatter(self)
                unit.set_custom_reduce_scatter(comm)
                self.comms.append(comm)
        self.root = root
        return {name: p for name, p in model.named_parameters() if p.requires_grad}

    def logprobs(
        self, batch: modeling.Batch, *, chunk_tokens: int, temperature: float, with_entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """modeling.completion_logprobs of the sharded model (inside the FSDP root)."""
        assert self.root is not None
        out: tuple[torch.Tensor, torch.Tensor] = self.root(
            batch, chunk_tokens=chunk_tokens, temperature=temperature, with_entropy=with_entropy
        )
        return out

    # -- a step's rounds ------------------------------------------------------------------

    def rounds(self, count: int) -> list[tuple[int, int]]:
        """For `count` micro-batches, what this rank runs in each round: (the micro-batch,
        how many ranks run a real one in the round). Rank r runs micro-batch start + r; a rank
        past the last one runs the round's first again, as padding (r >= live)."""
        n, r = self.world.size, self.world.rank
        return [
            (start + r if r < min(n, count - start) else start, min(n, count - start)) for start in range(0, count, n)
        ]

    def begin_step(self) -> None:
        """Before a step's (or a probe's) first backward: no running gradient sums."""
        for comm in self.comms:
            comm.running = None

    def before_backward(self, live: int, params: Mapping[str, torch.nn.Parameter]) -> None:
        """Before a round's backward: how many ranks add their gradient (`live`), and no shard
        gradient for FSDP2 to add onto (the running sums hold it)."""
        self.live = live
        if self.comms:
            for p in params.values():
                p.grad = None

    def any_true(self, flag: bool) -> bool:
        """Whether `flag` holds on any rank (every rank gets the same answer)."""
        t = torch.tensor([1.0 if flag else 0.0], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def sum(self, values: Sequence[float]) -> list[float]:
        """Each value summed over the ranks, in fp64."""
        t = torch.tensor(list(values), dtype=torch.float64)
        dist.all_reduce(t)
        return [float(x) for x in t]

    def sum_of_squares(self, local: float) -> float:
        """HostAdamW's `reduce`: the gradient's sum of squares over every shard."""
        return self.sum([local])[0]

    # -- rank 0 leads, the others follow ------------------------------------------------------

    def lead(self, command: str, fields: Mapping[str, Any] | None = None, payload: bytes = b"") -> None:
        """Rank 0: send every rank the next command (a JSON header) and its bytes."""
        header = json.dumps({"command": command, **(fields or {})}).encode()
        self._broadcast(header)
        self._broadcast(payload)

    def follow(self) -> tuple[dict[str, Any], bytes]:
        """Ranks > 0: rank 0's next command (the header, with "command") and its bytes."""
        header = json.loads(self._broadcast(b"").decode())
        return header, self._broadcast(b"")

    def _broadcast(self, data: bytes) -> bytes:
        size = torch.tensor([len(data)], dtype=torch.int64)
        dist.broadcast(size, src=0)
        if int(size) == 0:
            return b""
        buffer = (
            torch.frombuffer(bytearray(data), dtype=torch.uint8)
            if self.lead_rank
            else torch.empty(int(size), dtype=torch.uint8)
        )
        dist.broadcast(buffer, src=0)
        return buffer.numpy().tobytes()

    # -- the published weights ---------------------------------------------------------------

    def full_bits(
        self, params: Mapping[str, torch.nn.Parameter], local: Mapping[str, np.ndarray]
    ) -> dict[str, np.ndarray]:
        """Rank 0: every parameter's bf16 bits (uint16) in its full shape, from each rank's
        shard bits (`local`, by name, in the shard's shape); other ranks: {}. One rank: `local`
        itself (views, as one process's step returns them). FSDP2 pads each parameter's dim 0
        to a multiple of N, so every rank sends the same number of elements, in one gather."""
        n = self.world.size
        if n == 1:
            return {name: local[name].reshape(tuple(p.shape)) for name, p in params.items()}
        widths = {name: (-(-p.shape[0] // n) if p.dim() else 1) * math.prod(p.shape[1:]) for name, p in params.items()}
        # The bits travel as int32 pairs, which gloo and NCCL both gather (int16: gloo does not).
        mine = np.zeros(sum(widths.values()) + sum(widths.values()) % 2, dtype=np.uint16)
        at = 0
        for name, width in widths.items():
            piece = local[name].reshape(-1)
            mine[at : at + piece.size] = piece
            at += width
        send = torch.from_numpy(mine.view(np.int32))
        gathered = torch.empty((n, send.numel()), dtype=torch.int32) if self.lead_rank else None
        dist.gather(send, list(gathered.unbind(0)) if gathered is not None else None, dst=0)
        if gathered is None:
            return {}
        every = gathered.numpy().view(np.uint16)  # [rank, padded shards one after another]
        out: dict[str, np.ndarray] = {}
        at = 0
        for name, p in params.items():
            width = widths[name]
            out[name] = every[:, at : at + width].reshape(-1)[: p.numel()].reshape(tuple(p.shape))
            at += width
        return out


def shard_rows(whole: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """The rows of `whole` (in `param`'s full shape) that this rank's shard of `param` (a
    DTensor) holds: FSDP2 cuts dim 0 as torch.chunk does, ceil(rows / N) a rank, the last
    ranks' shorter or empty."""
    assert isinstance(param, DTensor)
    n, r = param.device_mesh.size(), param.device_mesh.get_local_rank()
    rows = -(-whole.shape[0] // n)
    return whole[r * rows : (r + 1) * rows]


def encode_groups(groups: Sequence[rollout_pb2.RolloutGroup]) -> bytes:
    """A step's groups as one payload: each group's protobuf after its length (uint32, LE)."""
    return b"".join(struct.pack("<I", len(data)) + data for data in (g.SerializeToString() for g in groups))


def decode_groups(payload: bytes) -> list[rollout_pb2.RolloutGroup]:
    groups, at = [], 0
    while at < len(payload):
        (size,) = struct.unpack_from("<I", payload, at)
        groups.append(rollout_pb2.RolloutGroup.FromString(payload[at + 4 : at + 4 + size]))
        at += 4 + size
    return groups


class _Forward(torch.nn.Module):
    """The FSDP root: the model's completion log-probs as one module call."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(
        self, batch: modeling.Batch, *, chunk_tokens: int, temperature: float, with_entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return modeling.completion_logprobs(
            self.model, batch, chunk_tokens=chunk_tokens, temperature=temperature, with_entropy=with_entropy
        )


def leave(code: int, together: bool = True) -> NoReturn:
    """End a rank: with `together`, every rank at a barrier and the process group destroyed
    (without: a rank failing alone, the others in some other collective); output flushed, then
    os._exit. A normal interpreter exit after gloo's worker threads ran aborts the process in
    Py_FinalizeEx (SIGABRT, seen in 1 exit in 5 at 2 ranks), which torchrun reports as a
    failure of the whole job."""
    if together and dist.is_initialized():
        try:
            dist.barrier()
            dist.destroy_process_group()
        except RuntimeError:  # a rank already gone: torchrun ends the job anyway
            pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
