"""The trainer's figures: its own Prometheus metrics (`Metrics`, docs/observability.md; the
pipeline's streams, as the trainer sees them, come from rollstream.core.dashboard.PipelineView)
and the trackers, TRL's `report_to`: each step's metrics, each eval round's and the run
configuration also go to TensorBoard, MLflow or W&B, through each library's own writer, under
`tracker_dir`:

  tensorboard  tracker_dir/tensorboard: torch.utils.tensorboard's SummaryWriter (event files)
  mlflow       tracker_dir/mlruns: a local file store (tracking URI file:...), experiment = the
               run's name, one MLflow run per trainer start; config as params, metrics by step
  wandb        tracker_dir/wandb/offline-run-*: W&B in offline mode (no network, ever;
               `wandb sync` uploads it later); config as the run's config

Each is an optional extra (pip install 'rollstream-trainer[tensorboard]', [mlflow], [wandb]):
a missing one fails at start, when the settings load (config.py calls missing_extras). A
tracker that fails later (a full disk, a library error) is logged once and turned off: the
figures are a copy, the run goes on (steps.jsonl is the complete record). Non-finite values
are left out.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from pydantic import SecretStr

from rollstream.core import logs, steplog
from rollstream.v1 import rollout_pb2

if TYPE_CHECKING:
    from rollstream.trainer.config import SftSettings, TrainerSettings

# The trainer host's own logger: its lines say "trainer" also where a generator shares the process (colocated).
log = logging.getLogger("rollstream.trainer")


class Tracker(ABC):
    """One backend: written to by one thread at a time (Trackers holds a lock)."""

    module: ClassVar[str]  # what its extra installs: imported only when the backend is used

    @abstractmethod
    def __init__(self, folder: Path, run: str) -> None: ...

    @abstractmethod
    def log_config(self, config: Mapping[str, Any]) -> None: ...

    @abstractmethod
    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None: ...

    @abstractmethod
    def close(self) -> None: ...


class TensorBoard(Tracker):
    module = "tensorboard"

    def __init__(self, folder: Path, run: str) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(folder / "tensorboard"))

    def log_config(self, config: Mapping[str, Any]) -> None:
        # TensorBoard's text plugin renders markdown: the configuration as a JSON code block.
        self.writer.add_text("config", "```json\n" + json.dumps(dict(config), indent=2, sort_keys=True) + "\n```")
        self.writer.flush()

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, global_step=step)
        # A step takes seconds: flushed each time, a killed trainer's curve loses no point.
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class MLflow(Tracker):
    module = "mlflow"

    def __init__(self, folder: Path, run: str) -> None:
        from mlflow.tracking import MlflowClient

        # MlflowClient, not mlflow's module-level functions: no process-wide tracking URI or
        # active run that anything else in the process could see or change.
        self.client = MlflowClient(tracking_uri=(folder / "mlruns").resolve().as_uri())
        experiment = self.client.get_experiment_by_name(run)
        experiment_id = experiment.experiment_id if experiment is not None else self.client.create_experiment(run)
        self.run_id = self.client.create_run(experiment_id, run_name=run).info.run_id

    def log_config(self, config: Mapping[str, Any]) -> None:
        from mlflow.entities import Param
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH

        # Params are strings of at most MAX_PARAM_VAL_LENGTH characters, at most
        # MAX_PARAMS_TAGS_PER_BATCH a call; set once (MLflow refuses to change one).
        params = [Param(key, value[:MAX_PARAM_VAL_LENGTH]) for key, value in flatten(config).items()]
        for start in range(0, len(params), MAX_PARAMS_TAGS_PER_BATCH):
            self.client.log_batch(self.run_id, params=params[start : start + MAX_PARAMS_TAGS_PER_BATCH])

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        from mlflow.entities import Metric
        from mlflow.utils.time import get_current_time_millis

        now = get_current_time_millis()
        self.client.log_batch(self.run_id, metrics=[Metric(name, value, now, step) for name, value in metrics.items()])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class WandB(Tracker):
    module = "wandb"
    STEP = "step"  # the x-axis of every chart (see log_metrics)

    def __init__(self, folder: Path, run: str) -> None:
        import wandb

        folder.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            dir=str(folder), project=run, name=run, mode="offline",
            settings=wandb.Settings(
                silent=True, console="off", disable_git=True, save_code=False,
                x_disable_stats=True, x_disable_machine_info=True, x_save_requirements=False,
            ),
        )  # fmt: skip
        # An eval round is reported when its last group is in, after later steps may have been
        # logged, and W&B drops a row whose own step is behind its last: so every row carries
        # the trainer's step as a metric and the charts use that as their x-axis.
        self.run.define_metric(self.STEP)
        self.run.define_metric("*", step_metric=self.STEP)

    def log_config(self, config: Mapping[str, Any]) -> None:
        self.run.config.update(dict(config), allow_val_change=True)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        self.run.log({**metrics, self.STEP: step})

    def close(self) -> None:
        import wandb

        self.run.finish()
        # finish() can return while W&B's service process still writes the run's file (CI read
        # it with its last record cut short under load); teardown waits for that process.
        wandb.teardown()


# report_to's names (config.py's Literal) -> backend; a new one is a class and a line here.
BACKENDS: dict[str, type[Tracker]] = {"tensorboard": TensorBoard, "mlflow": MLflow, "wandb": WandB}

# No network exists where rollstream trains, and none is wanted: MLflow's usage telemetry and
# W&B's error reports stay off (both read these before their first use, in this process and
# in W&B's service process that inherits the environment). MLflow 3 put its file store in
# maintenance mode and refuses it unless allowed: its SQL store needs SQLAlchemy and Alembic
# (a database migration at every open), and a folder of plain files is what a run folder holds.
_ENV = {
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "MLFLOW_ALLOW_FILE_STORE": "true",
    "WANDB_ERROR_REPORTING": "false",
    "WANDB_MODE": "offline",
}


def missing_extras(report_to: Sequence[str], modules: Mapping[str, str] | None = None) -> str:
    """Why report_to cannot work here ("" when it can): the backends whose package is not
    installed, with the pip command. `modules`: backend name -> module to look for (default:
    each backend's own)."""
    modules = modules if modules is not None else {name: cls.module for name, cls in BACKENDS.items()}
    missing = [name for name in report_to if importlib.util.find_spec(modules[name]) is None]
    if not missing:
        return ""
    packages = " and ".join(modules[name] for name in missing)
    return (
        f"report_to = {list(report_to)} needs the {packages} package{'s' if len(missing) > 1 else ''}: "
        f"pip install 'rollstream-trainer[{','.join(missing)}]'"
    )


class Trackers:
    """The run's trackers (none when report_to is empty). Never raises from logging: a backend
    that fails is logged (tracker_failed, ERROR) and turned off."""

    def __init__(self, backends: Mapping[str, Tracker] | None = None) -> None:
        self.backends: dict[str, Tracker] = dict(backends or {})
        self._lock = threading.Lock()  # the loop's steps and the eval code's rounds

    @classmethod
    def from_settings(cls, settings: TrainerSettings | SftSettings, run: str) -> Trackers:
        if not settings.report_to:
            return cls()
        os.environ.update(_ENV)
        folder = Path(settings.tracker_dir)
        backends: dict[str, Tracker] = {}
        for name in settings.report_to:
            try:
                backends[name] = BACKENDS[name](folder, run)
            except Exception as e:  # noqa: BLE001 - any library error: the run trains without this tracker
                _failed(name, "opening", e)
        if backends:
            logs.event(log, "trackers_open", trackers=",".join(backends), folder=str(folder))
        return cls(backends)

    def log_config(self, config: Mapping[str, Any]) -> None:
        self._each("logging the configuration", lambda t: t.log_config(config))

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """`metrics` by name ("train/reward_mean", "eval/accuracy") at trainer step `step`;
        non-finite values, and what is no number, are left out."""
        finite = {name: x for name, x in ((name, _number(v)) for name, v in metrics.items()) if math.isfinite(x)}
        if finite:
            self._each(f"logging step {step}", lambda t: t.log_metrics(finite, step))

    def close(self) -> None:
        self._each("closing", lambda t: t.close())
        self.backends.clear()

    def _each(self, doing: str, call: Callable[[Tracker], None]) -> None:
        with self._lock:
            for name, tracker in list(self.backends.items()):
                try:
                    call(tracker)
                except Exception as e:  # noqa: BLE001 - a full disk, a library error: this copy of the figures stops, the run goes on
                    _failed(name, doing, e)
                    del self.backends[name]
                    try:
                        tracker.close()
                    except Exception:  # noqa: BLE001 - already failed and reported
                        pass


def _number(value: object) -> float:
    """`value` as a float; NaN (left out) for what is no number."""
    try:
        return float(value)  # type: ignore[arg-type]  # anything float() takes: numpy scalars, tensors of one
    except (TypeError, ValueError):
        return math.nan


def _failed(name: str, doing: str, error: BaseException) -> None:
    logs.event(
        log,
        "tracker_failed",
        logging.ERROR,
        tracker=name,
        doing=doing,
        error=f"{type(error).__name__}: {error}",
        turned_off=True,
    )


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested mappings as `a.b` keys, every value as text (lists as JSON): MLflow's params."""
    out: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten(value, name + "."))
        else:
            out[name] = value if isinstance(value, str) else json.dumps(value)
    return out


def run_config(settings: TrainerSettings | SftSettings) -> dict[str, Any]:
    """The settings as JSON values, secrets left out: redis_url (it can hold a password), the
    SecretStr fields, and the fields that name where a password or token is kept."""
    secret = {
        name for name, info in type(settings).model_fields.items()
        if name == "redis_url" or info.annotation is SecretStr or "password" in name or "token_file" in name
    }  # fmt: skip
    return settings.model_dump(mode="json", exclude=secret)


def figures(message: Message, prefix: str) -> dict[str, float]:
    """A metrics message's numeric fields as <prefix>/<name>, float32 ones at the 7 significant
    digits they hold (as steps.jsonl has them); `step` is the x-axis and `time` no curve."""
    out: dict[str, float] = {}
    for f in message.DESCRIPTOR.fields:
        value = getattr(message, f.name)
        if f.name in ("step", "time") or isinstance(value, bool) or not isinstance(value, int | float):
            continue
        out[f"{prefix}/{f.name}"] = float(f"{value:.7g}") if f.type == FieldDescriptor.TYPE_FLOAT else float(value)
    return out


def step_metrics(metrics: Message, phases: Mapping[str, float]) -> dict[str, float]:
    """A committed step's figures: StepMetrics as train/<field>, its phase times as
    time/<phase> (seconds)."""
    return figures(metrics, "train") | {
        f"time/{phase.removesuffix('_s')}": float(seconds) for phase, seconds in phases.items()
    }


def eval_metrics(metrics: Message) -> dict[str, float]:
    """A held-out round's figures (EvalMetrics) as eval/<field>: eval/accuracy, eval/pass_at_k, ..."""
    return figures(metrics, "eval")


@dataclass
class Reports:
    """Where a committed step's and a held-out round's figures go: the step log (`metrics_file`,
    steps.jsonl, the complete record), the trackers (report_to) and, for a round, Prometheus
    and the log. A disk that refuses a step-log line costs the curve a point, never the run:
    logged, and training goes on."""

    run: str
    metrics_file: str  # "": no step log
    log: logging.Logger
    trackers: Trackers = field(default_factory=Trackers)

    def step(
        self, metrics: rollout_pb2.StepMetrics, phases: Mapping[str, float], skipped: str = "", reanchored: str = ""
    ) -> None:
        """The step's line, with `delta_skipped` (why no delta was encoded: delta_bytes is then
        0) and `reanchored` (why an anchor was written, for a reader that appeared) when they
        happened; the same figures to the trackers."""
        self.trackers.log_metrics(step_metrics(metrics, phases), metrics.step)
        if self.metrics_file:
            record = steplog.record(metrics, run=self.run, phases=phases)
            record.update({k: v for k, v in (("delta_skipped", skipped), ("reanchored", reanchored)) if v})
            self._append(record, step=metrics.step)

    def evaluated(self, m: rollout_pb2.EvalMetrics, prometheus: Metrics) -> None:
        """A reported round: Prometheus, the trackers, the log, the step log's eval line."""
        prometheus.observe_eval(m)
        self.trackers.log_metrics(eval_metrics(m), m.step)
        logs.event(self.log, "evaluated", step=m.step, version=m.version, version_max=m.version_max, prompts=m.prompts,
                   prompts_fed=m.prompts_fed, samples=m.samples, accuracy=round(m.accuracy, 4),
                   pass_at_k=round(m.pass_at_k, 4), reward=round(m.reward_mean, 4))  # fmt: skip
        if self.metrics_file:
            self._append(steplog.eval_record(m, run=self.run), eval_step=m.step)

    def _append(self, record: dict[str, Any], **where: int) -> None:
        try:
            steplog.append(self.metrics_file, record)
        except OSError as e:
            logs.event(self.log, "step_log_failed", logging.ERROR, path=self.metrics_file, error=str(e), **where)


@dataclass(frozen=True)
class Metrics:
    steps: Counter
    policy_version: Gauge
    groups: Counter
    tokens: Counter
    zero_variance_groups: Counter
    reward_mean: Gauge
    reward_std: Gauge
    loss: Gauge
    kl: Gauge
    clip_fraction: Gauge
    entropy: Gauge
    grad_norm: Gauge
    staleness: Histogram
    step_seconds: Histogram
    phase_seconds: Histogram
    delta_bytes: Histogram
    delta_dense_ratio: Gauge
    deltas_skipped: Counter
    reanchors: Counter

    @classmethod
    def register(cls, registry: CollectorRegistry) -> "Metrics":
        p = "rollstream_trainer_"
        mib = 1 << 20
        return cls(
            steps=Counter(p + "steps", "optimizer steps committed", registry=registry),
            policy_version=Gauge(p + "policy_version", "current policy version", registry=registry),
            groups=Counter(
                p + "groups",
                "groups consumed from ready, by outcome (trained, stale, duplicate, evaluated)",
                ["outcome"],
                registry=registry,
            ),
            tokens=Counter(p + "tokens", "completion tokens trained", registry=registry),
            zero_variance_groups=Counter(
                p + "zero_variance_groups",
                "trained groups whose rewards were all equal (no gradient; dapo drops them)",
                registry=registry,
            ),
            reward_mean=Gauge(p + "reward_mean", "mean reward of the last step's completions", registry=registry),
            reward_std=Gauge(p + "reward_std", "standard deviation of the last step's rewards", registry=registry),
            loss=Gauge(p + "loss", "loss of the last step", registry=registry),
            kl=Gauge(p + "kl", "mean KL to the reference (k3) of the last step", registry=registry),
            clip_fraction=Gauge(
                p + "clip_fraction",
                "fraction of the last step's tokens whose policy gradient the clip removed",
                registry=registry,
            ),
            entropy=Gauge(p + "entropy", "mean token entropy of the last step", registry=registry),
            grad_norm=Gauge(p + "grad_norm", "gradient norm of the last step (before clipping)", registry=registry),
            staleness=Histogram(
                p + "group_staleness_versions",
                "versions between the policy that sampled a trained group and the one it updates",
                buckets=(0, 1, 2, 3, 4, 6, 8, 16),
                registry=registry,
            ),
            step_seconds=Histogram(
                p + "step_seconds",
                "wall time of one step (forward, backward, optimizer, delta encode)",
                buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
                registry=registry,
            ),
            phase_seconds=Histogram(
                p + "step_phase_seconds",
                "wall time of one phase of a step (forward, backward, optimizer, delta_encode, push, commit)",
                ["phase"],
                buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
                registry=registry,
            ),
            delta_bytes=Histogram(
                p + "delta_bytes",
                "size of each published weight payload (delta or anchor)",
                buckets=(64 << 10, 256 << 10, mib, 4 * mib, 16 * mib, 64 * mib, 256 * mib, 1 << 30, 4 << 30, 16 << 30),
                registry=registry,
            ),
            delta_dense_ratio=Gauge(
                p + "delta_dense_ratio", "last payload's size / the dense bf16 weights'", registry=registry
            ),
            deltas_skipped=Counter(
                p + "deltas_skipped",
                "versions published without a delta: nobody would read it (publisher.Readers)",
                registry=registry,
            ),
            reanchors=Counter(
                p + "reanchors",
                "anchors written because a reader appeared after deltas were skipped",
                registry=registry,
            ),
        )

    def observe_step(
        self, m: "rollout_pb2.StepMetrics", stalenesses: list[int], nbytes: int, fraction: float, skipped: bool = False
    ) -> None:
        self.steps.inc()
        self.policy_version.set(m.version)
        self.groups.labels(outcome="trained").inc(m.groups)
        self.tokens.inc(m.tokens)
        self.zero_variance_groups.inc(m.zero_variance_groups)
        for gauge, value in ((self.reward_mean, m.reward_mean), (self.reward_std, m.reward_std), (self.loss, m.loss), (self.kl, m.kl),
                             (self.clip_fraction, m.clip_fraction), (self.entropy, m.entropy), (self.grad_norm, m.grad_norm)):  # fmt: skip
            gauge.set(value)
        for s in stalenesses:
            self.staleness.observe(s)
        self.step_seconds.observe(m.step_seconds)
        if skipped:  # no payload: counted, not observed as a size
            self.deltas_skipped.inc()
            return
        self.delta_bytes.observe(nbytes)
        self.delta_dense_ratio.set(fraction)

    def observe_eval(self, m: "rollout_pb2.EvalMetrics") -> None:
        # The round's figures are gauges of the pipeline view (core/dashboard.py), read from the evals stream.
        self.groups.labels(outcome="evaluated").inc(m.prompts)
