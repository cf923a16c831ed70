"""`rollstream plot RUN`: a run's curves as one PNG, from its step log (core/steplog.py).

Panels against the step, two a row: the training reward (mean with a +-std band); held-out
accuracy (and pass@k when rounds sample more than once) and held-out reward, as points at the
steps the log's eval lines name; the mean completion length; entropy; gradient norm; the
step's phases (stacked seconds); loss; KL; staleness; the delta's size as % of the dense bf16
weights; training tokens/s. An SFT run's log (`rollstream sft`) has no rewards, completions,
KL, staleness or deltas: its panels are the loss, the held-out loss (its eval lines), the
gradient norm, the phases and tokens/s.

A panel whose series is constant over the whole run (the demo's KL and staleness are 0 every
step) tells nothing and is left out; the figure's bottom line names what was left out and at
which value. The training reward and the held-out panels are always drawn: a reward or an
accuracy that did not move is the finding. matplotlib (a Figure saved to PNG, no display
needed) is the `plot` extra of rollstream-core.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from rollstream.core import steplog

if TYPE_CHECKING:
    from matplotlib.figure import Figure
    from rich.console import Console

PHASES = ("forward_s", "backward_s", "optimizer_s", "delta_encode_s", "push_s", "commit_s")  # steplog's phase fields


class PlotError(RuntimeError):
    """The step log cannot be plotted (missing, empty, nothing readable, no matplotlib)."""


@dataclass
class Series:
    label: str
    x: list[int]
    y: list[float]  # NaN where a record lacks the value: a gap in the line


@dataclass
class Panel:
    title: str
    series: list[Series]
    style: Literal["line", "points", "stack"] = "line"
    always: bool = False  # drawn even when constant
    band: tuple[list[float], list[float]] | None = None  # the reward's +-std
    ylim: tuple[float, float] | None = None

    def constant(self) -> list[float] | None:
        """The values the series hold when none of them moves over the run (empty: the log
        holds none); None when one moves."""
        held = [{v for v in s.y if math.isfinite(v)} for s in self.series]
        if any(len(values) > 1 for values in held):
            return None
        return sorted(set().union(*held))


def resolve_log(run: Path) -> Path:
    """RUN is an `up` run folder (its steps.jsonl) or a step log file."""
    path = run / steplog.FILE_NAME if run.is_dir() else run
    if not path.exists():
        where = f"{run} has no {steplog.FILE_NAME}" if run.is_dir() else f"{run} does not exist"
        raise PlotError(
            f"{where}: no step log (the trainer writes it with --metrics-file; `rollstream up` puts it in WORKDIR/{steplog.FILE_NAME})"
        )
    return path


def _value(rec: dict, name: str, scale: float = 1.0) -> float:
    v = rec.get(name)
    return float(v) * scale if isinstance(v, int | float) and not isinstance(v, bool) else math.nan


def _ratio(rec: dict, num: str, den: str, scale: float = 1.0) -> float:
    n, d = _value(rec, num), _value(rec, den)
    return scale * n / d if d else math.nan  # NaN also when either is missing


def panels(log: steplog.StepLog) -> tuple[list[Panel], list[str]]:
    """The panels to draw, and the ones left out as constant ("KL (k3, per token) = 0")."""
    steps = [r["step"] for r in log.steps]

    def line(title: str, values: list[float]) -> Panel:
        return Panel(title, [Series(title, steps, values)])

    # A GRPO run's log has rewards and eval rounds of accuracy; an SFT run's (`rollstream sft`)
    # neither, and its eval lines hold a held-out loss: each panel is drawn where its run has it.
    grpo = any("reward_mean" in r for r in log.steps) or any("eval_accuracy" in e for e in log.evals)
    candidates: list[Panel] = []
    if grpo:
        reward = [_value(r, "reward_mean") for r in log.steps]
        std = [_value(r, "reward_std") for r in log.steps]
        candidates += [Panel("reward (train, mean ± std)", [Series("reward", steps, reward)], always=True,
                             band=([m - s for m, s in zip(reward, std)], [m + s for m, s in zip(reward, std)]))]  # fmt: skip
    if log.evals and grpo:
        at = [e["step"] for e in log.evals]
        held = [Series("accuracy", at, [_value(e, "eval_accuracy", 100.0) for e in log.evals])]
        if any(_value(e, "eval_samples") > 1 for e in log.evals):
            held.append(Series("pass@k", at, [_value(e, "eval_pass_at_k", 100.0) for e in log.evals]))
        candidates += [
            Panel("held-out accuracy (%)", held, style="points", always=True, ylim=(-5.0, 110.0)),
            Panel(
                "held-out reward (mean)",
                [Series("reward", at, [_value(e, "eval_reward_mean") for e in log.evals])],
                style="points",
                always=True,
            ),
        ]
    if any("eval_loss" in e for e in log.evals):
        at = [e["step"] for e in log.evals]
        loss = [Series("loss", at, [_value(e, "eval_loss") for e in log.evals])]
        candidates.append(Panel("held-out loss (per trained token)", loss, style="points", always=True))
    phases = [
        Series(p.removesuffix("_s"), steps, [_value(r, p) for r in log.steps])
        for p in PHASES
        if any(p in r for r in log.steps)
    ]
    # (panel, only GRPO's log has its series)
    rest = [
        (line("completion length (tokens trained / completions)", [_ratio(r, "tokens", "completions") for r in log.steps]), True),
        (line("entropy (nats per token)", [_value(r, "entropy") for r in log.steps]), True),
        (line("gradient norm (before clipping)", [_value(r, "grad_norm") for r in log.steps]), False),
        (Panel("step phases (s, stacked)", phases, style="stack"), False),
        (line("loss", [_value(r, "loss") for r in log.steps]), False),
        (line("KL (k3, per token)", [_value(r, "kl") for r in log.steps]), True),
        (line("mean staleness (versions)", [_value(r, "mean_staleness") for r in log.steps]), True),
        (line("delta size (% of dense bf16)", [_ratio(r, "delta_bytes", "dense_bytes", 100.0) for r in log.steps]), True),
        (line("training tokens/s", [_value(r, "train_tokens_per_s") for r in log.steps]), False),
    ]  # fmt: skip
    candidates += [panel for panel, grpo_only in rest if grpo or not grpo_only]
    shown, left_out = [], []
    for p in candidates:
        values = p.constant()
        if p.always or values is None:
            shown.append(p)
        elif p.series:  # a panel with no series (no phase times in the log) is not news
            left_out.append(
                f"{p.title} = {values[0]:g}"
                if len(values) == 1
                else f"{p.title} ({'constant' if values else 'not in the log'})"
            )
    return shown, left_out


def figure(log: steplog.StepLog, title: str) -> Figure:
    """The run's curves as a matplotlib Figure (two panels a row); each axes' title is its
    panel's, the bottom line names the panels left out."""
    try:
        from matplotlib.figure import Figure
    except ImportError as e:
        raise PlotError(f"matplotlib is not installed ({e}): pip install 'rollstream-core[plot]'") from e
    shown, left_out = panels(log)
    if not shown:  # one step (a short SFT): every series is a single value
        raise PlotError(f"every value is constant: {'; '.join(left_out)}")
    rows = math.ceil(len(shown) / 2)
    # A Figure of its own, not pyplot's: no global figure list to leak into, no display needed
    # (savefig picks the Agg canvas for a PNG).
    fig = Figure(figsize=(12, 2.4 * rows + 0.8), layout="constrained")
    grid = fig.subplots(rows, 2, squeeze=False)
    axes = list(grid.flat)
    for extra in axes[len(shown) :]:
        extra.remove()
    first, last = log.steps[0]["step"], log.steps[-1]["step"]
    if log.evals:
        first, last = min(first, log.evals[0]["step"]), max(last, log.evals[-1]["step"])
    marker = "o" if len(log.steps) <= 60 else None
    for ax, p in zip(axes, shown):
        if p.style == "stack":
            layers = [[0.0 if math.isnan(v) else v for v in s.y] for s in p.series]
            ax.stackplot(p.series[0].x, *layers, labels=[s.label for s in p.series], alpha=0.8)
            ax.set_ylim(
                0.0, 1.45 * max(map(sum, zip(*layers)), default=1.0) or 1.0
            )  # room for the legend above the stack
            ax.legend(fontsize=7, loc="upper left", ncol=3)
        for i, s in enumerate(p.series if p.style != "stack" else ()):
            if p.style == "points":
                ax.plot(s.x, s.y, marker="o", markersize=6, linewidth=1, linestyle="--", label=s.label)
                for x, y in zip(s.x, s.y):
                    if math.isfinite(y):  # the first series' values below its points, a second's above
                        ax.annotate(f"{y:.3g}", (x, y), textcoords="offset points", xytext=(0, -12 if i == 0 and len(p.series) > 1 else 6),
                                    ha="center", fontsize=7)  # fmt: skip
            else:
                ax.plot(s.x, s.y, marker=marker, markersize=3, linewidth=1.5)
        if p.style == "points" and len(p.series) > 1:
            ax.legend(fontsize=7, loc="lower right")
        if p.band is not None:
            ax.fill_between(p.series[0].x, *p.band, alpha=0.2)
        if p.ylim is not None:
            ax.set_ylim(*p.ylim)
        ax.set_title(p.title, fontsize=10)
        ax.set_xlim(first - 0.5, last + 0.5)
        ax.grid(True, alpha=0.3)
        ax.ticklabel_format(axis="y", useOffset=False)
    n = len(log.steps)
    evals = f", {len(log.evals)} held-out rounds" if log.evals else ""
    fig.suptitle(f"rollstream run {title}: {n} steps{evals}")
    fig.supxlabel(
        "step" + (f"\nconstant over the run, left out: {'; '.join(left_out)}" if left_out else ""), fontsize=9
    )
    return fig


def render(log_path: Path, out: Path, title: str = "") -> tuple[Path, steplog.StepLog]:
    """Render the step log at `log_path` into the PNG `out`; returns the path and what was read
    (its `skipped` lines are for the caller to warn about)."""
    log = steplog.read(log_path)
    if not log.steps:
        extra = f" ({len(log.skipped)} unreadable lines)" if log.skipped else ""
        raise PlotError(f"{log_path}: no step records{extra}")
    fig = figure(log, title or str(log.steps[-1].get("run") or log_path.parent.name))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    return out, log


def render_at_end(step_log: Path, out: Path, console: Console) -> None:
    """A run's curves when it ends (`up`, `sft`), said on `console`; a plotting failure is
    reported, never fatal."""
    try:
        path, log = render(step_log, out)
    except PlotError as e:
        console.print(f"no curve: {e}", style="yellow", soft_wrap=True)
        return
    console.print(
        f"curves: {path}" + (f" ({len(log.skipped)} unreadable lines of {step_log} skipped)" if log.skipped else ""),
        soft_wrap=True,
    )
