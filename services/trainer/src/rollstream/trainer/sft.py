"""`rollstream sft`: supervised fine-tuning on the trainer's engine, read top to bottom.

  1. settings    SftSettings (trainer/config.py) from flags, `--config FILE` ([sft] table) and
                 ROLLSTREAM_SFT_* variables; a bad value stops here, naming the field
  2. folders     the out folder must be new, empty or an earlier export (checked now, not
                 after hours of training); WORKDIR holds checkpoints/, steps.jsonl, trackers/
  3. model       loaded as the trainer loads it (lora.load), attending within each example
                 of a packed row (packed_attention.py), its optimizer HostAdamW as GRPO's
                 (the shared HostOptimizerSettings): fp32 masters on the host, a float32
                 model's own parameters on the CPU
  4. data        the whole dataset tokenized, validated and packed before the model loads
                 (its tokenizer is enough) and before any step (sft_data.prepare: every
                 bad row named by row and field, then nothing runs); a held-out part:
                 eval_fraction of the packed rows, or eval_dataset; of its rows with an
                 answer (answer_field), the first eval_prompts' prompts (sft_eval.py)
  5. resume      --resume latest (or a folder): the optimizer state, torch's RNG and the step,
                 which is the data position (the order is a function of seed, epoch and step)
  6. steps       epochs of `batch_rows` packed rows each, in a seeded order per epoch; the
                 learning rate of each step from its number (TRL's linear schedule); each step
                 sft_step.sft_step; then a steps.jsonl line (`rollstream plot` draws it), the
                 trackers, a held-out loss every eval_every steps and after the last,
                 with the held-out score where rows have answers and a scorer was given
                 (greedy completions scored by the reward service's recipes: reward_mean,
                 accuracy, as GRPO's held-out evaluation; sft_eval.py), a checkpoint every
                 checkpoint_every steps and at the last (the GRPO trainer's format,
                 checkpoint.py: `rollstream export` reads it too)
  7. export      the model folder (export.py's writer: save_pretrained + tokenizer), what
                 `rollstream up --model OUT` starts GRPO from

Killed at any point, `--resume latest` trains on to the same bits as a run never stopped:
the checkpoint holds the masters, moments, step count and RNG, and nothing else decides a
step (tests/integration/test_sft_command.py kills a real process with SIGKILL).
"""

from __future__ import annotations

import json
import math
import sys
import tomllib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer

from rollstream.core import cpu_runtime, deltas, modeling, steplog
from rollstream.core.config import ConfigError, load_settings
from rollstream.core.models import ModelNotFoundError, context_length, resolve_model
from rollstream.trainer import checkpoint, export, lora, packed_attention, sft_eval, trackers
from rollstream.trainer.config import SftSettings
from rollstream.trainer.optimizer import HostAdamW, NonFiniteStep
from rollstream.trainer.sft_data import PackedRow, SftDataConfig, SftDataError, prepare
from rollstream.trainer.sft_step import SftStepConfig, micro_batches, sft_step

SUMMARY = "summary.json"  # in the workdir, as `up` writes one
TABLE = "sft"  # the table of a --config / --profile file this command reads
# Settings a resume must share with the checkpoint: they decide which rows each step takes
# and its learning rate. The others (threads, checkpoint_every, report_to...) may change.
SAME_ON_RESUME = (
    "dataset", "split", "max_length", "packing", "truncate", "all_tokens", "eval_fraction", "seed", "batch_rows",
    "epochs", "max_steps", "lr", "lr_scheduler", "warmup_steps", "betas", "weight_decay", "max_grad_norm",
)  # fmt: skip
AfterStep = Callable[[int], None]


class SftError(RuntimeError):
    """The run cannot go on: a model not found, a checkpoint of another run, a non-finite step."""


@dataclass
class Data:
    train: list[PackedRow]
    held_out: list[PackedRow]
    examples: int


# -- 1. settings --------------------------------------------------------------------------------


def settings_argv(argv: Sequence[str], profiles: Path | None = None) -> list[str]:
    """`--sft.<field>` as `--<field>` (the spelling `rollstream up` uses for its sections), and
    `--profile NAME|PATH` (a name: a file in `profiles`) as `--config` of that file when it has
    an [sft] table: a profile is `up`'s, where the table is optional."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        flag, eq, value = argv[i].partition("=")
        if flag == "--profile" and (eq or i + 1 < len(argv)):
            path = _profile_path(value if eq else argv[i + 1], profiles)
            if has_table(path, TABLE):
                out += ["--config", str(path)]
            i += 1 if eq else 2
            continue
        out.append("--" + argv[i].removeprefix("--sft.") if argv[i].startswith("--sft.") else argv[i])
        i += 1
    return out


def reward_file(argv: Sequence[str], profiles: Path | None = None) -> Path | None:
    """The file `--config PATH` or `--profile NAME|PATH` names, where it has a [reward] table:
    the launcher's held-out score takes the reward's settings from it (reward.items.ItemScorer)."""
    for i, arg in enumerate(argv):
        flag, eq, value = arg.partition("=")
        if flag in ("--config", "--profile") and (eq or i + 1 < len(argv)):
            name = value if eq else argv[i + 1]
            path = _profile_path(name, profiles) if flag == "--profile" else Path(name)
            return path if has_table(path, "reward") else None
    return None


def _profile_path(name: str, profiles: Path | None) -> Path:
    """A profile's file: a bare name is a file in `profiles`, anything else a path."""
    named = profiles is not None and "/" not in name and not name.endswith(".toml")
    return profiles / f"{name}.toml" if named and profiles is not None else Path(name)


def has_table(path: Path, table: str) -> bool:
    """Whether the TOML file has the table; one that cannot be read counts as having it, so
    that load_settings says what is wrong with it."""
    try:
        return table in tomllib.loads(path.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return True


def load(argv: Sequence[str], profiles: Path | None = None) -> SftSettings:
    """SftSettings from defaults < the [sft] table of --config < ROLLSTREAM_SFT_* < flags."""
    return load_settings(SftSettings, settings_argv(argv, profiles), table=TABLE)


def main(
    argv: Sequence[str],
    profiles: Path | None = None,
    after_step: AfterStep | None = None,
    scorer: sft_eval.Scorer | None = None,
) -> int:
    """The command: 0 when the model is exported, 2 for a bad setting or bad data (nothing
    trained), 1 when the run stopped (the latest checkpoint is where --resume latest goes on).
    `scorer`: the reward's recipes, for the held-out score (the launcher's; sft_eval.py)."""
    try:
        run(load(argv, profiles), after_step, scorer)
        return 0
    except (ConfigError, SftDataError, export.ExportError, checkpoint.CheckpointError, ValueError) as e:
        print(e, file=sys.stderr)
        return 2
    except SftError as e:
        print(e, file=sys.stderr)
        return 1


# -- 2-7. the run -------------------------------------------------------------------------------


def run(s: SftSettings, after_step: AfterStep | None = None, scorer: sft_eval.Scorer | None = None) -> Path:
    """Train as `s` says and export the model; returns the out folder. `after_step(step)` is
    called once a step is recorded (and checkpointed, when one is due): tests stop the
    process there. With `scorer`, held-out rows that have answers are also scored (sft_eval)."""
    # 2. Folders: the out folder is refused now if it could be someone's model.
    out, workdir = Path(s.out).absolute(), s.folder.absolute()
    export.check_output(out)
    if not s.tracker_dir:
        s = s.model_copy(update={"tracker_dir": str(workdir / "trackers")})
    ckpt_dir = workdir / "checkpoints"
    log_path = workdir / steplog.FILE_NAME
    # 3. The model (4. and the data first), as the trainer loads it.
    cpu_runtime.fixed_mmap_threshold()
    if s.threads:
        torch.set_num_threads(s.threads)
    torch.manual_seed(s.seed)
    model_dir = model_folder(s)
    # 4. The data, all of it checked before anything trains, and before the model loads (minutes
    # for a large one): its tokenizer is all the data needs.
    data_tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    data = load_data(s, data_tokenizer)
    scoring = sft_eval.held_out_score(s, data.held_out, data_tokenizer, scorer, workdir)
    model, tokenizer, _, params = lora.load(
        model_dir, s.dtype, s.device, None, s.activation_checkpointing, s.activation_checkpointing_every
    )
    packed_attention.use(model)  # each example of a packed row attended on its own, no T^2 mask
    model.train()
    # No sync_model: the first step computes with the weights as loaded, as TRL's. A float32
    # model then computes on the masters themselves (TRL's fp32 run): on the CPU they are its
    # parameters, on a GPU copied up (onto_masters); a bfloat16 one on their bf16 rounding, as
    # GRPO's (docs/design-notes.md, "SFT (issue 46): the model's weights after a step").
    in_model = s.dtype == "float32" and torch.device(s.device).type == "cpu"
    on_masters = s.dtype == "float32" and not in_model
    optimizer = s.host_adamw(params, in_model)
    per_epoch = math.ceil(len(data.train) / s.batch_rows)
    total = min(s.max_steps, s.epochs * per_epoch) if s.max_steps else s.epochs * per_epoch
    rows_said = f"{len(data.train)} packed rows to train on ({len(data.held_out)} held out)"
    print(f"sft: {data.examples} examples, {rows_said}, {per_epoch} steps an epoch, {total} steps", file=sys.stderr)
    # 5. Resume.
    step = resume(s, ckpt_dir, optimizer, params, model_dir) if s.resume else 0
    if step and on_masters:
        onto_masters(optimizer, params)
    # 6. The steps.
    cfg = SftStepConfig(s.token_budget, s.chunk_tokens, s.max_grad_norm, s.device)
    pad_id = tokenizer.pad_token_id
    tracked = trackers.Trackers.from_settings(s, s.run)
    tracked.log_config(trackers.run_config(s))
    try:
        while step < total:
            rows = [data.train[i] for i in step_rows(len(data.train), s.batch_rows, s.seed, step)]
            optimizer.lr = s.lr * lr_factor(step, total, s.warmup_steps, s.lr_scheduler)
            try:
                # The update runs on into the next forward, as GRPO's (each module waits for its
                # buckets; a checkpoint, a held-out round, the export wait too): the same bits.
                result = sft_step(model, optimizer, rows, cfg, pad_id=pad_id, background=not on_masters)
                if on_masters:
                    onto_masters(optimizer, params)
            except NonFiniteStep as e:
                raise SftError(
                    f"step {step + 1}: {e}; nothing applied (the latest checkpoint is in {ckpt_dir})"
                ) from None
            except torch.OutOfMemoryError as e:
                raise SftError(too_long(s, step + 1, rows, e, ckpt_dir)) from None
            step += 1
            log_step(step_record(s, step, result, optimizer.lr, step / per_epoch), log_path, tracked)
            if data.held_out and ((s.eval_every and step % s.eval_every == 0) or step == total):
                held = held_out_round(model, tokenizer, data.held_out, cfg, scoring, step)
                log_held_out(s.run, step, held, log_path, tracked)
            if (s.checkpoint_every and step % s.checkpoint_every == 0) or step == total:
                save(s, ckpt_dir, step, optimizer, params)
            if after_step is not None:
                after_step(step)
    finally:
        tracked.close()
    # 7. The model folder.
    trained = export.Trained(model_dir, optimizer, None, optimizer.published_bits(), step, step, str(ckpt_dir))
    written = export.export(trained, out, s.export_dtype)
    write_summary(workdir / SUMMARY, log_path, written)
    print(f"sft: {step} steps; the model is in {written} (rollstream up --model {written})", file=sys.stderr)
    return written


def write_summary(path: Path, log_path: Path, out: Path) -> None:
    """WORKDIR/summary.json from the step log (the whole run's, across resumes): the loss
    curve, the held-out losses (and scores), the mean tokens/s, where the model is."""
    log = steplog.read(log_path) if log_path.exists() else steplog.StepLog()
    losses = [r["loss"] for r in log.steps]
    speeds = [r["train_tokens_per_s"] for r in log.steps if r.get("train_tokens_per_s")]
    summary = {
        "steps": len(log.steps),
        "loss_curve": [round(x, 4) for x in losses],
        "first_loss": losses[0] if losses else None,
        "last_loss": losses[-1] if losses else None,
        "held_out": [
            {"step": e["step"], "loss": e["eval_loss"]}
            | {k: e[f"eval_{k}"] for k in ("reward_mean", "accuracy") if f"eval_{k}" in e}
            for e in log.evals
        ],
        "train_tokens_per_s": round(sum(speeds) / len(speeds), 1) if speeds else None,
        "model": str(out),
    }
    path.write_text(json.dumps(summary, indent=2) + "\n")


def model_folder(s: SftSettings) -> str:
    """The model's folder, refused (naming the field) when it is missing or when a packed row of
    max_length tokens would not fit in its context: positions past it were never trained."""
    try:
        model_dir = str(resolve_model(s.model))
    except ModelNotFoundError as e:
        raise SftError(f"model: {e}") from None
    if 0 < (context := context_length(model_dir)) < s.max_length:
        raise ValueError(f"max_length {s.max_length}: over the model's context of {context} tokens ({model_dir})")
    return model_dir


def load_data(s: SftSettings, tokenizer: Any) -> Data:
    """The packed rows to train on and the held-out ones: eval_dataset's, or a seeded
    eval_fraction of the dataset's packed rows (whole examples: packing never splits one)."""
    config = SftDataConfig(s.max_length, s.packing, s.truncate, s.all_tokens, s.split)
    data = prepare(s.dataset, tokenizer, config)
    rows, held_out = data.rows, []
    if s.eval_dataset:
        held_out = prepare(s.eval_dataset, tokenizer, config).rows
    elif s.eval_fraction:
        n = round(len(rows) * s.eval_fraction)
        if n == 0 or n == len(rows):
            raise ValueError(
                f"eval_fraction {s.eval_fraction} of {len(rows)} packed rows leaves no held-out or no training row"
            )
        order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(s.seed)).tolist()
        held = set(order[:n])
        held_out = [r for i, r in enumerate(rows) if i in held]
        rows = [r for i, r in enumerate(rows) if i not in held]
    return Data(rows, held_out, data.examples)


def step_rows(n_rows: int, batch_rows: int, seed: int, step: int) -> list[int]:
    """The packed rows step `step` (0-based) trains on: epoch e takes the rows in the order of a
    generator seeded with seed + e, batch_rows at a time (the last step of an epoch what is
    left, as TRL's sampler with drop_last off). A function of the step alone: a resumed run
    takes the same rows as one never stopped, with nothing saved but the step."""
    per_epoch = math.ceil(n_rows / batch_rows)
    epoch, k = divmod(step, per_epoch)
    order = torch.randperm(n_rows, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
    return order[k * batch_rows : (k + 1) * batch_rows]


def lr_factor(step: int, total: int, warmup: int, schedule: str) -> float:
    """The learning rate's multiplier at step `step` (0-based) of `total`: transformers'
    linear schedule with warmup (TRL's default), or constant after warmup."""
    if step < warmup:
        return step / max(1, warmup)
    if schedule == "constant":
        return 1.0
    return max(0.0, (total - step) / max(1, total - warmup))


def held_out_round(
    model: Any,
    tokenizer: Any,
    rows: Sequence[PackedRow],
    cfg: SftStepConfig,
    scoring: sft_eval.HeldOutScore | None,
    step: int,
) -> dict[str, float]:
    """A held-out round after `step`: the loss, and the score where there is one (sft_eval),
    by the names steps.jsonl's eval line (eval_<name>) and the trackers (eval/<name>) give them."""
    held = {"loss": held_out_loss(model, rows, cfg, tokenizer.pad_token_id)}
    if scoring is not None:
        held |= scoring.evaluate(model, tokenizer, step)
    return held


def too_long(s: SftSettings, step: int, rows: Sequence[PackedRow], error: Exception, ckpt_dir: Path) -> str:
    """Why step `step` stopped on the device's memory, naming the lengths that did not fit and
    what lowers them."""
    longest = max(len(r.input_ids) for r in rows)
    first_line = str(error).splitlines()[0] if str(error) else type(error).__name__
    if not s.activation_checkpointing:
        lower = "lower max_length or token_budget, or turn activation_checkpointing on"
    elif s.activation_checkpointing_every > 1:
        lower = "lower max_length or token_budget, or activation_checkpointing_every (1: every layer)"
    else:
        lower = "lower max_length or token_budget"
    return (
        f"step {step}: out of memory on {s.device} with packed rows of up to {longest} tokens "
        f"(max_length {s.max_length}, token_budget {s.token_budget} a micro-batch): {first_line}; "
        f"{lower} (the latest checkpoint is in {ckpt_dir})"
    )


def log_step(record: dict[str, Any], log_path: Path, tracked: trackers.Trackers) -> None:
    """A step's steps.jsonl line (step_record) and the trackers' train/<name>."""
    steplog.append(log_path, record)
    figures = {f"train/{k}": v for k, v in record.items() if k not in ("schema", "run", "step", "utc")}
    tracked.log_metrics(figures, record["step"])


def log_held_out(run: str, step: int, held: dict[str, float], log_path: Path, tracked: trackers.Trackers) -> None:
    """A held-out round's steps.jsonl eval line (eval_loss, eval_accuracy...) and trackers' eval/<name>."""
    steplog.append(log_path, {"schema": steplog.SCHEMA, "run": run, "kind": steplog.EVAL_KIND, "step": step,
                              **{f"eval_{k}": v for k, v in held.items()}, "utc": _utc()})  # fmt: skip
    tracked.log_metrics({f"eval/{k}": v for k, v in held.items()}, step)


def held_out_loss(model: torch.nn.Module, rows: Sequence[PackedRow], cfg: SftStepConfig, pad_id: int) -> float:
    """The mean negative log-likelihood per trained token of the held-out rows (the training
    loss's definition), without gradients, in a step's micro-batches (sft_step.micro_batches)."""
    total, count = 0.0, 0
    with torch.no_grad():
        for _, batch in micro_batches(rows, cfg, pad_id):
            logp, _ = modeling.completion_logprobs(model, batch, chunk_tokens=cfg.chunk_tokens)
            total -= float(logp.double().sum())
            count += int(batch.targets.numel())
    return total / max(1, count)


def step_record(s: SftSettings, step: int, r: Any, lr: float, epoch: float) -> dict[str, Any]:
    """A step's steps.jsonl line (core/steplog.py): `rollstream plot` draws loss, gradient
    norm and tokens/s from it."""
    seconds = r.forward_s + r.backward_s + r.optimizer_s
    return {
        "schema": steplog.SCHEMA,
        "run": s.run,
        "step": step,
        "epoch": round(epoch, 6),
        "loss": r.loss,
        "grad_norm": r.grad_norm,
        "lr": lr,
        "tokens": r.tokens,
        "train_tokens": r.train_tokens,
        "examples": r.examples,
        "rows": r.rows,
        "micro_batches": r.micro_batches,
        "seconds": round(seconds, 6),
        "train_tokens_per_s": round(r.train_tokens / seconds, 3) if seconds > 0 else None,
        "forward_s": round(r.forward_s, 6),
        "backward_s": round(r.backward_s, 6),
        "optimizer_s": round(r.optimizer_s, 6),
        "utc": _utc(),
    }


def _utc() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds")


# -- checkpoints --------------------------------------------------------------------------------


@torch.no_grad()
def onto_masters(optimizer: HostAdamW, params: dict[str, torch.nn.Parameter]) -> None:
    """Write the unrounded fp32 masters into a float32 model's parameters on a GPU (on the CPU
    they are the masters: HostAdamW's in_model): an update of
    lr 2e-5 is far below a bf16 step of most weights, so on their bf16 rounding the model
    would learn late (docs/benchmarks.md, "The SFT step against TRL's SFTTrainer")."""
    for name, master in optimizer.master.items():
        params[name].copy_(master)


def _fingerprint(params: dict[str, torch.nn.Parameter]) -> str:
    return deltas.model_fingerprint({name: tuple(p.shape) for name, p in params.items()})


def save(
    s: SftSettings, ckpt_dir: Path, step: int, optimizer: HostAdamW, params: dict[str, torch.nn.Parameter]
) -> Path:
    """The checkpoint of `step` in the GRPO trainer's format (checkpoint.py): the optimizer's
    masters and moments, torch's RNG, the step (the data position: step_rows) and the
    settings (`rollstream export` rebuilds the model from them); older ones pruned to
    keep_checkpoints."""
    state = checkpoint.CheckpointState(
        version=step,
        step=step,
        optimizer_steps=optimizer.step_count,
        prompts_fed=step * s.batch_rows,  # packed rows drawn so far (informational: the step decides)
        run=s.run,
        model_fingerprint=_fingerprint(params),
        moments_dtype=s.moments_dtype,
        master_layout=optimizer.masters.name,
        settings={**s.model_dump(mode="json"), "command": "sft"},
    )
    saved, _removed = checkpoint.save_own(
        ckpt_dir,
        step,
        s.keep_checkpoints,
        lambda target: checkpoint.save(target, state, optimizer.state_tensors(), checkpoint.rng_state(), replace=True),
    )
    return saved


def resume(
    s: SftSettings, ckpt_dir: Path, optimizer: HostAdamW, params: dict[str, torch.nn.Parameter], model_dir: str
) -> int:
    """Restore the checkpoint `s.resume` names into `optimizer` (and through it the model) and
    torch's RNG; return its step. A checkpoint of another model, of a GRPO run or of other
    data or schedule settings is refused, naming what differs."""
    path = checkpoint.resolve(s.resume, str(ckpt_dir))
    if path is None:
        return 0
    state = checkpoint.load_state(path)
    if state.settings.get("command") != "sft":
        raise checkpoint.CheckpointError(f"{path} is not an SFT checkpoint (a GRPO trainer's?)")
    now = s.model_dump(mode="json")
    for name in SAME_ON_RESUME:
        if state.settings.get(name) != now[name]:
            raise checkpoint.CheckpointError(
                f"{name}: {path} was trained with {state.settings.get(name)!r}, this run says {now[name]!r}; "
                "a resume must take the same rows at the same learning rate"
            )
    if state.moments_dtype != s.moments_dtype:
        raise checkpoint.CheckpointError(
            f"moments_dtype: {path} holds {state.moments_dtype} moments, this run says {s.moments_dtype}"
        )
    state.check_model(path, params, None, model_dir)
    optimizer.load_state(checkpoint.optimizer_tensors(path), state.optimizer_steps)
    checkpoint.set_rng_state(checkpoint.rng_tensors(path))
    print(f"sft: resumed from {path} at step {state.step}", file=sys.stderr)
    return state.step
