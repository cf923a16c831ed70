"""Read back what report_to's trackers wrote under a tracker_dir, each with its library's own
reader: TensorBoard's EventAccumulator, MLflow's MlflowClient, W&B's DataStore (the offline
run's .wandb file, records parsed as W&B's own protobuf Record)."""

from __future__ import annotations

import json
import os
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Written:
    """One tracker's account of a run: each metric by step, and the configuration."""

    series: dict[str, dict[int, float]] = field(default_factory=lambda: defaultdict(dict))
    config: dict[str, Any] = field(default_factory=dict)


def tensorboard(folder: Path) -> Written:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    out = Written()
    for tag in events.Tags()["scalars"]:
        out.series[tag] = {e.step: e.value for e in events.Scalars(tag)}
    if "config/text_summary" in events.Tags()["tensors"]:
        text = events.Tensors("config/text_summary")[-1]  # one a trainer start: the last
        markdown = text.tensor_proto.string_val[0].decode()
        out.config = json.loads(markdown.removeprefix("```json\n").removesuffix("\n```"))
    return out


def mlflow(folder: Path, experiment: str) -> tuple[Written, Any]:
    """The experiment's one run: what it holds (config: its params, text), and the run itself."""
    # As trackers.py writes: MLflow 3's file store needs allowing, and no telemetry (before the import).
    os.environ.update(MLFLOW_ALLOW_FILE_STORE="true", MLFLOW_DISABLE_TELEMETRY="true")
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(folder / "mlruns").resolve().as_uri())
    found = client.get_experiment_by_name(experiment)
    assert found is not None, f"no MLflow experiment {experiment!r} under {folder}"
    (run,) = client.search_runs([found.experiment_id])
    out = Written(config=dict(run.data.params))
    for key in run.data.metrics:
        out.series[key] = {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}
    return out, run


def wandb_records(folder: Path) -> list[Any]:
    """Every record of the one offline run under `folder`, through W&B's own DataStore."""
    from wandb.proto import wandb_internal_pb2
    from wandb.sdk.internal import datastore

    (path,) = folder.glob("wandb/offline-run-*/run-*.wandb")
    store = datastore.DataStore()
    store.open_for_scan(str(path))
    out = []
    while (data := store.scan_data()) is not None:
        record = wandb_internal_pb2.Record()  # type: ignore[attr-defined]  # the module picks its classes by protobuf version
        record.ParseFromString(data)
        out.append(record)
    return out


def _key(item: Any) -> str:
    """A history or config item's name: W&B's core writes it as `nested_key` (a path)."""
    return str(item.key) or ".".join(item.nested_key)


def wandb(folder: Path, step_metric: str = "step") -> tuple[Written, list[Any]]:
    """The offline run's metrics by the trainer's step (each row carries it as `step_metric`),
    its config, and the raw records."""
    records = wandb_records(folder)
    out = Written()
    for r in records:
        kind = r.WhichOneof("record_type")
        if kind == "history":
            row = {_key(item): json.loads(item.value_json) for item in r.history.item}
            for name, value in row.items():
                if not name.startswith("_") and name != step_metric:
                    out.series[name][row[step_metric]] = value
        elif kind == "config":
            out.config.update({_key(u): json.loads(u.value_json) for u in r.config.update})
    return out, records
