"""The trainer's state: the model, the host-memory optimizer and the weight publisher
(`Trainer`), one step on them (`train_step`: step.train_step, then the new version published;
`train_and_push`: also pushed, recorded by the loop, counted) and checkpoints of all of it. Its
gRPC face and in-process view are in servicer.py, the loop in service.py."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from rollstream.core import deltas, logs, validation
from rollstream.core.grpc_auth import ClientCredentials, load_roles
from rollstream.core.models import context_length, vocab_size
from rollstream.core.service import ServiceHost
from rollstream.trainer import checkpoint, ranks
from rollstream.trainer.config import TrainerSettings
from rollstream.trainer.optimizer import HostAdamW
from rollstream.trainer.publisher import NO_READER, Published, WeightPublisher
from rollstream.trainer.push import BACKED_OFF, PushOutcome
from rollstream.trainer.ranks import Ranks
from rollstream.trainer.servicer import WeightsView
from rollstream.trainer.step import nonfinite_groups, train_step
from rollstream.trainer.trackers import Metrics
from rollstream.trainer.trained import Trained
from rollstream.v1 import rollout_pb2


def _limits(s: TrainerSettings, model_dir: str) -> validation.Limits:
    """What a ready group may hold: ids inside the vocabulary, completions no longer than the
    tasks this trainer feeds ask for (dr_grpo normalises by that length), prompt + completion
    inside the model's context (a longer one cannot be run: checked here, at intake, not found by
    a failed allocation minutes into a step), exactly the run's group size, bounded rewards."""
    return validation.Limits(
        vocab_size=vocab_size(model_dir),
        max_new_tokens=s.max_new_tokens,
        max_reward_abs=s.max_abs_reward,
        max_context_tokens=context_length(model_dir),
        # Evaluation groups hold eval_samples completions: the size is then checked against
        # each group's own task (prompts.check_answers), which holds the run's for training tasks.
        group_size=s.group_size if not s.eval_prompts else 0,
        max_group_size=max(s.group_size, s.eval_samples),
    )


class Trainer:
    def __init__(self, settings: TrainerSettings, host: ServiceHost, team: Ranks | None = None):
        """The trainer's state; with `team` (rank 0 of N, ranks.py) the model's shards, the others
        doing what this one leads (follower.py)."""
        s = self.settings = settings
        self.log = host.log
        self.team = team
        trained = Trained.load(s, team)
        self.trained = trained
        self.model_dir = trained.model_dir
        self.limits = _limits(s, self.model_dir)
        self.need_ref = s.beta > 0 and s.kl_reference == "service"
        self.model, self.tokenizer, self.lora, self.params = (
            trained.model,
            trained.tokenizer,
            trained.lora,
            trained.params,
        )
        # pi_ref from the frozen base under the adapters: the groups need no ref_logprobs.
        self.ref_from_base = s.beta > 0 and s.kl_reference == "lora_base"
        self.adapters_off = self.lora.model.disable_adapter if self.ref_from_base and self.lora is not None else None
        self.step_config = trained.step_config
        self.optimizer: HostAdamW = trained.optimizer
        self.step = 0
        self.groups_trained = 0
        self.groups_stale = 0
        self.last_truncated_fraction = 0.0
        self.last_phases: dict[str, float] = {}  # the last step's phase times (seconds), for the step log
        self.last_skipped = ""  # why the last step's delta was not encoded ("": it was)
        # Why an anchor was written at the last step's start or end, for a reader that appeared ("": none).
        self.last_reanchor = ""
        self.overlapped = False  # whether the last step's update ran on while the next forward started
        # Held through each step: in the split master layout the published bits are the
        # optimizer's masters, rewritten in place, so a reader of the whole weights (GetState's
        # sha256) waits for the step and its version to be published, and for an overlapped
        # step's update, which goes on after the lock is let go (optimizer.wait).
        self.weights_lock = threading.Lock()
        self._after_step: list[Callable[[], None]] = []  # WeightsView.after_step's hooks
        self.restored: checkpoint.CheckpointState | None = None
        version = 0
        path = checkpoint.resolve(s.resume, s.checkpoint_dir) if s.resume else None
        if s.resume in ("auto", "latest"):
            self._log_unusable(checkpoint.scan(Path(s.checkpoint_dir)), resuming_from=str(path))
        if team is not None:  # the other ranks resume from what this one chose (a shared folder)
            team.lead("start", {"resume": str(path) if path is not None else ""})
        if path is not None:
            self.restored = self._restore(path)
            version = self.restored.version
            bits = self._published_bits(self.optimizer.published_bits())
            logs.event(self.log, "resumed", checkpoint=str(path), step=self.step, version=version)
        else:
            # Version 0 = bf16 rounding of the checkpoint; the model computes with exactly that.
            bits = self._published_bits(self.optimizer.sync_model())
        self.publisher = WeightPublisher(
            bits,
            s.anchor_interval,
            version=version,
            creds=ClientCredentials.from_settings(s),
            encode_threads=s.encode_threads(),
            anchor_dir=Path(s.anchor_dir) if s.anchor_dir else None,
            nonce_timeout_s=s.push_nonce_timeout_s,
            stall_s=s.push_stall_s,
            generator_key=load_roles(s.grpc_auth_file).generator_key if s.grpc_auth_file else None,
            run=s.run,
        )
        self.weights = WeightsView(self.publisher, self._after_step)
        self.metrics = Metrics.register(host.registry)
        self.metrics.policy_version.set(version)

    @property
    def version(self) -> int:
        return self.publisher.version

    def _published_bits(self, trained_bits: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """What generators get: the trained weights (N ranks: every rank's shards joined), or
        with LoRA the merged base weights."""
        if self.team is not None:
            return self.team.full_bits(self.params, trained_bits)
        return self.lora.merged_bits() if self.lora is not None else trained_bits

    # -- checkpoints ------------------------------------------------------------------

    def save_checkpoint(
        self, path: Path, prompts_fed: int = 0, consumer: str = "", replace: bool = False, trained_log_id: str = ""
    ) -> Path:
        """Write everything a resume needs (call between steps)."""
        s = self.settings
        state = checkpoint.CheckpointState(
            version=self.version,
            step=self.step,
            optimizer_steps=self.optimizer.step_count,
            groups_trained=self.groups_trained,
            groups_stale=self.groups_stale,
            prompts_fed=prompts_fed,
            run=s.run,
            consumer=consumer,
            consumer_group=s.group,
            model_fingerprint=self.publisher.fingerprint,
            moments_dtype=s.moments_dtype,
            master_layout=s.master_layout,
            trained_log_id=trained_log_id,
            base_weights_sha256=deltas.weights_sha256(self.lora.base_bits) if self.lora is not None else "",
            lora=self.lora.spec.as_dict() if self.lora is not None else None,
            # The Redis URL may carry a password: it stays out of the file.
            settings=s.model_dump(mode="json", exclude={"redis_url"}),
        )
        team = self.team

        def write_optimizer(folder: Path) -> None:
            if team is None:
                checkpoint.write_optimizer(folder, self.optimizer.state_tensors())
            else:  # every rank writes its shards into the same folder (follower.py)
                team.lead("save", {"folder": str(folder)})
                checkpoint.save_sharded_optimizer(folder, self.optimizer, self.params)

        saved = checkpoint.save(path, state, write_optimizer, checkpoint.rng_state(), replace=replace)
        logs.event(
            self.log,
            "checkpoint_saved",
            path=str(saved),
            step=self.step,
            version=self.version,
            mb=round(checkpoint.disk_bytes(saved) / 1e6, 1),
        )
        return saved

    def save_own_checkpoint(
        self, prompts_fed: int, consumer: str, trained_log_id: str, trim_log: Callable[[str], None]
    ) -> Path:
        """The trainer's own checkpoint, checkpoint_dir/step-N (what a restart resumes from), the
        folder pruned to keep_checkpoints (checkpoint.save_own), then `trim_log(id)`: the trained
        log may drop what is up to `id`, the oldest checkpoint a resume may need having those
        steps in its weights. `checkpoints_kept` is logged once all of it is done."""
        root, keep = Path(self.settings.checkpoint_dir), self.settings.keep_checkpoints
        saved, removed = checkpoint.save_own(
            root,
            self.step,
            keep,
            lambda target: self.save_checkpoint(
                target, prompts_fed=prompts_fed, consumer=consumer, replace=True, trained_log_id=trained_log_id
            ),
        )
        found = checkpoint.scan(root)
        oldest = checkpoint.fallback(found, keep)
        if oldest is not None and oldest.state.trained_log_id:
            trim_log(oldest.state.trained_log_id)
        logs.event(
            self.log,
            "checkpoints_kept",
            step=self.step,
            dir=str(root),
            kept=",".join(f.path.name for f in found.usable),
            removed=",".join(p.name for p in removed),
            dir_mb=round(checkpoint.disk_bytes(root) / 1e6, 1),
            keep=keep,
        )
        self._log_unusable(found)
        return saved

    def _log_unusable(self, found: checkpoint.Scan, **extra: str) -> None:
        # Skipped, never deleted: a torn copy, or a newer trainer's.
        for skipped, why in found.unusable:
            logs.event(self.log, "checkpoint_unusable", logging.ERROR, path=str(skipped), reason=why, **extra)

    def _restore(self, path: Path) -> checkpoint.CheckpointState:
        state = checkpoint.load_state(path)
        want_lora = self.lora.spec.as_dict() if self.lora is not None else None
        if state.lora != want_lora:
            raise checkpoint.CheckpointError(
                f"{path}: checkpoint LoRA config {state.lora} != this trainer's {want_lora}"
            )
        if state.moments_dtype != self.settings.moments_dtype:
            raise checkpoint.CheckpointError(
                f"{path}: checkpoint moments are {state.moments_dtype}, moments_dtype is {self.settings.moments_dtype}"
            )
        published = self.lora.base if self.lora is not None else self.params
        state.check_model(path, published, self.lora.base_bits if self.lora is not None else None, self.model_dir)
        self.trained.restore_optimizer(path, state, self.team)
        self.step = state.step
        self.groups_trained = state.groups_trained
        self.groups_stale = state.groups_stale
        return state

    # -- the step -----------------------------------------------------------------------

    def nonfinite_groups(self, groups: list[rollout_pb2.RolloutGroup]) -> dict[int, str]:
        """After a refused step: the groups that make it non-finite alone, index -> why
        (step.nonfinite_groups; nothing applied)."""
        if self.team is not None:
            self.team.lead("probe", payload=ranks.encode_groups(groups))
        return nonfinite_groups(
            self.model,
            self.optimizer,
            groups,
            self.step_config,
            pad_id=self.tokenizer.pad_token_id,
            adapters_off=self.adapters_off,
            ranks=self.team,
        )

    def train_step(
        self, groups: list[rollout_pb2.RolloutGroup]
    ) -> tuple[rollout_pb2.StepMetrics, Published | None, deltas.DeltaStats]:
        """One GRPO step (step.py), published as the next version: with its delta, or None when
        nobody would read one (publisher.Readers; last_skipped says why). Raises NonFiniteStep
        with nothing applied or published."""
        start = time.perf_counter()
        with self.weights_lock:  # the choice and the chain it needs, atomic with the step (reanchor)
            reader = self.publisher.readers.reader()
            self.last_reanchor = ""
            if reader and not self.publisher.has_chain:  # a reader the loop saw just before this step
                self._reanchor_locked(reader)
                self.last_reanchor = reader
            # Full fine-tuning: the trained parameters are the published weights, so the delta is
            # encoded tensor by tensor during the optimizer step. With LoRA the published weights
            # are merged after it.
            # N ranks: the bits are joined after the step, the delta encoded from them.
            encoder = self.publisher.begin_delta() if self.lora is None and reader and self.team is None else None
            background = self._overlap(reader)
            if self.team is not None:
                self.team.lead("step", payload=ranks.encode_groups(groups))
            r = train_step(
                self.model,
                self.optimizer,
                groups,
                self.step_config,
                pad_id=self.tokenizer.pad_token_id,
                adapters_off=self.adapters_off,
                on_piece=encoder.add_piece if encoder is not None else None,
                background=background,
                ranks=self.team,
            )
            # No update (dapo filtered every group): the version still advances, since the groups
            # were consumed, with an empty delta.
            new_bits = self.publisher.bits() if r.trained_bits is None else self._published_bits(r.trained_bits)
            encode_start = time.perf_counter()
            published: Published | None = None
            if reader:
                published, stats = self.publisher.publish(new_bits, encoder)
            else:
                if self.publisher.has_chain:  # once, as skipping starts; each step's line says it too
                    logs.event(self.log, "deltas_skipped", version=self.version + 1, reason=NO_READER)
                stats = self.publisher.skip(new_bits)
        self.last_skipped = "" if reader else "no reader"
        # delta_encode_s: what encoding took after the optimizer step (with delta_encode_threads,
        # most of it overlaps the step and is inside optimizer_s).
        self.last_phases = {
            "forward_s": r.forward_s,
            "backward_s": r.backward_s,
            "optimizer_s": r.optimizer_s,
            "delta_encode_s": time.perf_counter() - encode_start,
        }
        self.step += 1
        self.last_truncated_fraction = r.truncated_fraction
        step_seconds = time.perf_counter() - start
        staleness = [self.version - 1 - g.policy_version for g in groups]
        metrics = rollout_pb2.StepMetrics(
            step=self.step,
            version=self.version,
            groups=r.groups,
            completions=r.completions,
            reward_mean=r.reward_mean,
            reward_std=r.reward_std,
            loss=r.loss,
            kl=r.kl,
            clip_fraction=r.clip_fraction,
            entropy=r.entropy,
            tokens=r.tokens,
            step_seconds=step_seconds,
            train_tokens_per_s=r.train_tokens / step_seconds,
            delta_bytes=stats.nbytes,
            dense_bytes=stats.dense_bytes,
            mean_staleness=sum(staleness) / len(groups),
            grad_norm=r.grad_norm,
            time=time.time(),
            zero_variance_groups=r.zero_variance_groups,
        )
        self.metrics.observe_step(metrics, staleness, stats.nbytes, stats.fraction_of_dense, skipped=published is None)
        for phase, seconds in self.last_phases.items():
            self.metrics.phase_seconds.labels(phase=phase.removesuffix("_s")).observe(seconds)
        return metrics, published, stats

    def _overlap(self, reader: str) -> bool:
        """Whether the update runs on into the next forward (HostAdamW.step with the model): when nothing
        reads the new weights before it (no delta, no merge, no after-step hook); later readers wait (optimizer.wait)."""
        background = self.lora is None and not reader and not self._after_step and self.team is None
        if background != self.overlapped:  # said when it starts and when it stops
            logs.event(
                self.log,
                "optimizer_overlap",
                on=background,
                reason="nothing reads the weights before the next forward"
                if background
                else "LoRA merges after the update"
                if self.lora is not None
                else "the ranks join their bits after the update"
                if self.team is not None
                else "a follower copies the weights"
                if self._after_step
                else f"a delta for {reader}",
            )
            self.overlapped = background
        return background

    # -- what the loop calls: a step trained and pushed, a resume's replay and anchor, drops ----

    def train_and_push(
        self,
        groups: list[rollout_pb2.RolloutGroup],
        targets: Callable[[], list[str]],
        from_registry: bool,
        record: Callable[[rollout_pb2.StepMetrics, list[PushOutcome]], None],
    ) -> tuple[rollout_pb2.StepMetrics, deltas.DeltaStats, list[PushOutcome]]:
        """The loop's step: train_step (the previous version's push still going out meanwhile), the
        new version copied by the after-step hooks (WeightsView), the previous push waited for, `record` (the loop's
        commit of the groups and ledger, with that push's outcomes), the groups counted as
        trained, and only then the new version's push started in the background
        (fleet.BackgroundPush): the next step does not wait for it. The push targets are the
        readers' look for the next step (publisher.Readers); a step that skipped its delta
        pushes nothing, and when a reader has appeared since, the anchor is written now, at
        this version (last_reanchor says why), for it to catch up from. Returns the previous
        push's outcomes; last_phases gains push_s (the copies and the wait for the previous push;
        the push itself is the `push` phase of the metrics, timed on its own thread) and commit_s.
        Raises NonFiniteStep with nothing applied, published or pushed."""
        if not self.publisher.readers.reader():  # about to skip the delta: look again first
            self.publisher.readers.saw(targets(), from_registry)
        metrics, published, stats = self.train_step(groups)
        start = time.perf_counter()
        for hook in self._after_step:
            hook()
        before = self.publisher.pushes.wait()
        push_s = time.perf_counter() - start
        start = time.perf_counter()
        record(metrics, before)
        self.groups_trained += len(groups)
        self.last_phases.update(push_s=push_s, commit_s=time.perf_counter() - start)
        self.metrics.phase_seconds.labels(phase="push_wait").observe(push_s)
        self.metrics.phase_seconds.labels(phase="commit").observe(self.last_phases["commit_s"])
        addresses, version = targets(), self.version
        self.publisher.readers.saw(addresses, from_registry)
        if published is None:
            reader = self.publisher.readers.reader()
            if reader and self.reanchor(reader):
                self.last_reanchor = reader
            self.publisher.pushes.reached(version)  # nothing pushed: a new reader catches up from the anchor
            return metrics, stats, before
        self.publisher.pushes.start(version, lambda: self._push(addresses, published, from_registry, version))
        return metrics, stats, before

    def reanchor(self, why: str) -> bool:
        """After skipped deltas, a new chain from the current bits (publisher.reanchor), under
        the weights lock, for a reader that appeared (`why`); False when there is a chain
        already (another thread wrote it first)."""
        if self.publisher.has_chain:  # the common case, without waiting for a step to end
            return False
        with self.weights_lock:
            if self.publisher.has_chain:
                return False
            self._reanchor_locked(why)
        return True

    def _reanchor_locked(self, why: str) -> None:
        start = time.perf_counter()
        self.optimizer.wait()  # the anchor is the bits: the update in flight must have made them
        anchor = self.publisher.reanchor()
        self.metrics.reanchors.inc()
        logs.event(
            self.log,
            "reanchored",
            version=anchor.info.version,
            reason=why,
            seconds=round(time.perf_counter() - start, 3),
            filed=not isinstance(anchor.payload, bytes),
        )

    def _push(self, addresses: list[str], published: Published, from_registry: bool, version: int) -> list[PushOutcome]:
        """One version's push (on BackgroundPush's thread), logged when it ends."""
        start = time.perf_counter()
        outcomes = self.publisher.fleet.push(
            addresses,
            published,
            self.settings.push_timeout_s,
            from_registry=from_registry,
            fanout=self.settings.push_fanout,
        )
        for o in outcomes:
            if not o.applied and not o.error.startswith(BACKED_OFF):  # those: once when they failed, then in `pushed`
                logs.event(
                    self.log, "push_not_applied", logging.WARNING, generator=o.address, version=version, error=o.error
                )
        self.metrics.phase_seconds.labels(phase="push").observe(time.perf_counter() - start)
        logs.event(
            self.log,
            "pushed",
            version=version,
            applied=sum(o.applied for o in outcomes),
            generators=len(outcomes),
            seconds=round(time.perf_counter() - start, 3),
            backed_off=len(self.publisher.fleet.backoff.backed_off()),
        )
        return outcomes

    def replay_step(self, groups: list[rollout_pb2.RolloutGroup]) -> None:
        """A step of the trained log trained again after a resume (replay.py), and counted;
        pushed to no one (the anchor pushed after the resume carries it), copied by the after-step hooks."""
        self.train_step(groups)
        for hook in self._after_step:
            hook()
        self.groups_trained += len(groups)
        self.publisher.pushes.reached(self.version)

    def push_anchor(self, targets: list[str], from_registry: bool) -> None:
        """After a resume, every generator gets the restored version as an anchor, whatever it holds (a later
        version of the abandoned run, or the same number from another lineage); unreachable ones catch up later."""
        self.publisher.pushes.reached(self.version)
        self.publisher.readers.saw(targets, from_registry)
        if not targets:  # nobody to push to (the replayed steps may have skipped their deltas)
            logs.event(self.log, "anchor_pushed", version=self.version, applied=0, generators=0)
            return
        self.reanchor("after a resume: push targets")
        anchor = self.publisher.catch_up_payloads(-1, "")[0]
        outcomes = self.publisher.fleet.push(
            targets, anchor, self.settings.push_timeout_s, from_registry=from_registry, fanout=self.settings.push_fanout
        )
        logs.event(
            self.log,
            "anchor_pushed",
            version=self.version,
            applied=sum(o.applied for o in outcomes),
            generators=len(outcomes),
        )

    def count_dropped(self, outcome: str, n: int) -> None:
        """Groups the loop acknowledged without training them: "stale" or "duplicate"."""
        if outcome == "stale":
            self.groups_stale += n
        self.metrics.groups.labels(outcome=outcome).inc(n)

    def close(self) -> None:
        self.publisher.close()
