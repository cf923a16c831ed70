"""`rollstream plot RUN`: a run's curves as one PNG, from its step log (core/steplog.py).

Five panels against the step: reward mean with a +-std band, KL, training tokens/s, mean
staleness, and the delta's size as % of the dense bf16 weights. matplotlib with the Agg
backend (no display needed); matplotlib is the `plot` extra of rollstream-core.
"""

from __future__ import annotations

from pathlib import Path

from rollstream.core import steplog


class PlotError(RuntimeError):
    """The step log cannot be plotted (missing, empty, nothing readable, no matplotlib)."""


def resolve_log(run: Path) -> Path:
    """RUN is an `up` run folder (its steps.jsonl) or a step log file."""
    path = run / steplog.FILE_NAME if run.is_dir() else run
    if not path.exists():
        where = f"{run} has no {steplog.FILE_NAME}" if run.is_dir() else f"{run} does not exist"
        raise PlotError(f"{where}: no step log (the trainer writes it with --metrics-file; `rollstream up` puts it in WORKDIR/{steplog.FILE_NAME})")
    return path


def render(log_path: Path, out: Path, title: str = "") -> tuple[Path, steplog.StepLog]:
    """Render the step log at `log_path` into the PNG `out`; returns the path and what was read
    (its `skipped` lines are for the caller to warn about)."""
    log = steplog.read(log_path)
    if not log.steps:
        extra = f" ({len(log.skipped)} unreadable lines)" if log.skipped else ""
        raise PlotError(f"{log_path}: no step records{extra}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise PlotError(f"matplotlib is not installed ({e}): pip install 'rollstream-core[plot]'") from e

    def series(name: str, scale: float = 1.0) -> list[float]:
        return [float(r.get(name) or 0.0) * scale for r in log.steps]

    steps = [r["step"] for r in log.steps]
    reward, std = series("reward_mean"), series("reward_std")
    delta_pct = [100.0 * float(r.get("delta_bytes") or 0) / float(r["dense_bytes"]) if r.get("dense_bytes") else 0.0 for r in log.steps]
    panels = [
        ("reward (mean ± std)", reward),
        ("KL (k3, per token)", series("kl")),
        ("training tokens/s", series("train_tokens_per_s")),
        ("mean staleness (versions)", series("mean_staleness")),
        ("delta size (% of dense bf16)", delta_pct),
    ]
    fig, axes = plt.subplots(len(panels), 1, figsize=(8, 2.2 * len(panels)), sharex=True, constrained_layout=True)
    marker = "o" if len(steps) <= 60 else None
    for ax, (label, values) in zip(axes, panels):
        ax.plot(steps, values, marker=marker, markersize=3, linewidth=1.5)
        ax.set_ylabel(label, fontsize=9)
        ax.grid(True, alpha=0.3)
        ax.ticklabel_format(axis="y", useOffset=False)
    axes[0].fill_between(steps, [m - s for m, s in zip(reward, std)], [m + s for m, s in zip(reward, std)], alpha=0.2)
    axes[-1].set_xlabel("step")
    run = title or str(log.steps[-1].get("run") or log_path.parent.name)
    fig.suptitle(f"rollstream run {run}: {len(steps)} steps")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out, log
