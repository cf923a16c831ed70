"""The `rollstream` command.

rollstream up       the whole system as local processes: embedded redis-server (or
                    --redis-url), trainer, generator(s), reward, reference (when
                    beta > 0 and the trainer is not its own reference), with a live
                    progress display; Ctrl-C stops it all cleanly (up.py). Configured by a
                    profile (--profile, default demo), ROLLSTREAM_* variables and flags,
                    all generated from the services' settings classes (run_config.py):
                    `rollstream up --help` lists them
rollstream eval     `up` that trains nothing: one held-out round of a model (or of a run's
                    exported model) through the same generator and reward services
rollstream sft      supervised fine-tuning of a model on a dataset (conversations or
                    prompt/completion, JSONL or a datasets folder) on the trainer's
                    engine; the out folder is what `up --model` starts GRPO from
                    (trainer/sft.py; flags: rollstream sft --help)
rollstream config   the run configuration `up` would use, every value with its source
rollstream status   the pipeline of a run, read from Redis (--watch to follow), with a
                    line naming the bottleneck or the stuck stage (core/diagnose.py)
rollstream plot     a run's curves (reward, KL, tokens/s, staleness, delta size) as a PNG
rollstream export   a run's checkpoint as a Hugging Face folder (transformers, vLLM, peft
                    for a LoRA run's adapter) (trainer/export.py)
rollstream secrets  write a credentials folder: gRPC tokens per role, Redis ACL users,
                    and with --tls a CA and a certificate per role (docs/security.md)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

from pydantic import Field, SecretStr, ValidationError
from pydantic_settings import BaseSettings, CliSettingsSource, CliSuppress, SettingsConfigDict, SettingsError
from rich.console import Console, RenderableType
from rich.live import Live
from rich.text import Text

from rollstream.core import credentials, diagnose, redis_acl, redis_policy, run_keys, steplog
from rollstream.core import status as pipeline_status
from rollstream.core.config import ENV_PREFIX, NAME_PATTERN, CommonSettings, ConfigError, RedisUrl


def plain_console(**kwargs: object) -> Console:
    """A console that prints text as it is, never as rich markup: what `rollstream` prints
    holds what services, Redis streams and logs wrote (a rollout's group_id "evil[/]" in a
    log line raised MarkupError and ended `up`). Styles go in `style=` or rich.text.Text."""
    return Console(markup=False, **kwargs)  # type: ignore[arg-type]  # rich's own keywords, passed through


def cmd_up(argv: list[str]) -> int:
    # Imported here: `up` and `config` need the four services' settings classes (the
    # launcher's [up] extra); status, plot and secrets do not.
    from rollstream.launcher import run_config, up

    try:
        cfg = run_config.load(argv)
    except ConfigError as e:
        plain_console(stderr=True).print(str(e), style="red")
        return 2
    return up.cmd_up(cfg)


# `rollstream eval`'s own flags, and the run configuration's fields they stand for.
EVAL_FLAGS = {
    "--dataset": "--trainer.eval-dataset-path",
    "--prompts": "--trainer.eval-prompts",
    "--samples": "--trainer.eval-samples",
}
EVAL_PROMPTS = 100  # held-out prompts when --prompts is not given


def eval_argv(argv: list[str]) -> list[str]:
    """`rollstream eval`'s flags as `up`'s: --dataset, --prompts and --samples for the trainer's
    eval_* fields; --model a model folder or an `up` run folder (its exported model/); the run
    named `eval` unless --run says otherwise; and eval_only: one round, no training."""
    out: list[str] = []
    given: set[str] = set()
    i = 0
    while i < len(argv):
        flag, eq, value = argv[i].partition("=")
        has_value = bool(eq) or i + 1 < len(argv)
        if flag in (*EVAL_FLAGS, "--model", "--run") and has_value:
            if not eq:
                i += 1
                value = argv[i]
            given.add(flag)
            if flag == "--model" and (Path(value) / "model" / "config.json").is_file():
                value = str(Path(value) / "model")
            out += [EVAL_FLAGS.get(flag, flag), value]
        else:
            out.append(argv[i])
        i += 1
    if "--prompts" not in given and not any(a.startswith("--trainer.eval-prompts") for a in argv):
        out += ["--trainer.eval-prompts", str(EVAL_PROMPTS)]
    if "--run" not in given:
        out += ["--run", "eval"]
    return [*out, "--trainer.eval-only"]


def cmd_eval(argv: list[str]) -> int:
    """`up` that trains nothing: the held-out accuracy of a model with the same generator and
    reward services as training, to compare before and after."""
    if any(a in ("-h", "--help") for a in argv):
        print(
            "usage: rollstream eval --model DIR_OR_RUN [--dataset FILE] [--prompts N] [--samples K] [any `rollstream up` flag]\n\n"
            "One held-out round of the model (a Hugging Face folder, or an `up` run folder: its exported model/) through the same\n"
            "generator and reward services as training, then stop: accuracy (full marks), pass@K with --samples K > 1 (else greedy),\n"
            f"mean reward. --dataset: a JSONL/Parquet file or save_to_disk folder with the training fields (default: the task's own\n"
            f"held-out prompts, --trainer.eval-seed); --prompts: how many (default {EVAL_PROMPTS}). The result is in\n"
            "runs/eval/summary.json (held_out) and runs/eval/steps.jsonl. Every `rollstream up --help` flag applies."
        )
        return 0
    return cmd_up(eval_argv(argv))


def cmd_sft(argv: list[str]) -> int:
    """rollstream sft (trainer/sft.py): 0 with the model exported, 2 for bad settings or data, 1 for a stopped run."""
    try:
        from rollstream.reward.items import ItemScorer  # the held-out score's recipes (trainer/sft_eval.py)
        from rollstream.trainer import sft
    except ImportError as e:  # the launcher without its [up] extra
        plain_console(stderr=True).print(
            f"rollstream sft needs the trainer package (pip install 'rollstream-launcher[up]'): {e}", style="red"
        )
        return 2
    profiles = Path(__file__).parent / "profiles"  # run_config.PROFILES, without the services' imports
    with ItemScorer.from_config(sft.reward_file(argv, profiles)) as scorer:  # a profile's [reward]; pool started lazily
        code = sft.main(argv, profiles, scorer=scorer)
    if code == 0:  # the curves, as `up` draws them at its end
        from rollstream.launcher import plot

        workdir = sft.load(argv, profiles).folder
        plot.render_at_end(workdir / steplog.FILE_NAME, workdir / "curves.png", plain_console())
    return code


def cmd_config(argv: list[str]) -> int:
    """Print the run configuration as TOML, each value with where it came from, then `up`'s
    plan: each child's command and the file it reads."""
    import tomli_w

    from rollstream.launcher import plan, run_config

    try:
        found = run_config.layers(argv)
        rows = list(run_config.sources(found))
        cfg = run_config.build(found)
        the_plan = plan.plan(cfg, cfg.model, plan.redis_url_of(cfg), os.cpu_count() or 2)
    except (ConfigError, ValueError) as e:
        plain_console(stderr=True).print(str(e), style="red")
        return 2
    print(
        f"# rollstream up --profile {found.profile}: each value and its source (default, profile, environment, flags, set by up)"
    )
    section = ""
    for key, value, came in rows:
        head, _, name = key.rpartition(".")
        if head != section:
            section = head
            print(f"\n[{head}]")
        line = f"{name} = {_inline_toml(value)}" if value is not None else f"# {name} = (none)"
        print(f"{line}  # {came}")
    redis = "an embedded redis-server, an ACL user per role" if the_plan.embedded_redis else "the operator's"
    print(
        f"\n# `up`'s plan (plan.py), the trainer first: Redis {redis}; restart {the_plan.restart}; the model resolved at start"
    )
    for child in the_plan.children:
        print(
            f"# {child.name}: python -m rollstream.{' '.join(child.args(the_plan.workdir))} (and --state-file: where it says it serves)"
        )
        print(tomli_w.dumps({"plan": {child.name: child.config}}))
    if the_plan.external_reward is not None:
        print(f"# no reward process: {the_plan.external_reward.instructions()}".replace("\n", "\n# "))
    return 0


def _inline_toml(value: object) -> str:
    """A value as TOML on one line (tables and arrays inline)."""
    import tomli_w

    if isinstance(value, dict):
        return (
            "{ " + ", ".join(f"{json.dumps(k)} = {_inline_toml(v)}" for k, v in value.items()) + " }" if value else "{}"
        )
    if isinstance(value, list):
        return "[" + ", ".join(_inline_toml(v) for v in value) + "]"
    return tomli_w.dumps({"v": value})[4:].strip()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, someone else's
        return True
    return True


def redis_down_line(redis_url: str, error: Exception, workdir: Path | None, redis_pid: int) -> str:
    """What `status` says when Redis does not answer. An `up` run's embedded Redis stops with
    `up`: once its process is gone the run is over, and the line says where its results are
    rather than showing a refused connection to a port nobody serves any more."""
    if workdir is not None and redis_pid and not _pid_alive(redis_pid):
        return (
            f"this run's embedded Redis (pid {redis_pid}, {redis_policy.redact(redis_url)}) stopped with `rollstream up`: "
            f"the run is not running. Its results: {workdir / steplog.FILE_NAME} (a line per step), {workdir / 'summary.json'}, "
            f"{workdir / 'curves.png'} (`rollstream plot {workdir}` draws it again) and the services' logs in {workdir / 'logs'}; "
            f"`rollstream up --no-fresh --workdir {workdir} --run <run>` continues the run."
        )
    return f"Redis at {redis_policy.redact(redis_url)}: {redis_policy.short(error)}"


class StatusSettings(BaseSettings):
    """rollstream status: the pipeline of a run, read from Redis, with a line naming the
    bottleneck or the stuck stage."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        allow_inf_nan=False,
        cli_kebab_case=True,
        cli_exit_on_error=False,
        cli_show_env_vars=True,
        cli_prog_name="rollstream status",
    )

    redis_url: RedisUrl = Field(CommonSettings.model_fields["redis_url"].default, description="the run's Redis")
    run: str = Field(CommonSettings.model_fields["run"].default, pattern=NAME_PATTERN, description="the run's name")
    workdir: str = Field("", description="an `up` run's workdir: its embedded Redis, as admin (instead of --redis-url)")
    redis_username: str = Field("", description="Redis ACL user (under `up`: admin; empty: the URL's or none)")
    redis_password_file: str = Field(
        "", description="its password's file (under `up`: WORKDIR/credentials/redis/admin.password)"
    )
    redis_password: CliSuppress[SecretStr] = Field(
        SecretStr(""), description="the password, from the environment only (prefer the file)"
    )
    watch: float = Field(
        0.0,
        ge=0,
        description="refresh every N seconds (a live view; rates are per second between refreshes); 0: show once",
    )
    idle_s: float = Field(
        300.0, gt=0, description="consumers idle this long with a backlog (and no progress) count as not reading"
    )
    max_staleness: int = Field(
        1, ge=0, description="the run's max_staleness: generators further behind the trainer are flagged"
    )


def cmd_status(argv: list[str]) -> int:
    console = plain_console()
    try:
        args = StatusSettings(_cli_settings_source=CliSettingsSource(StatusSettings)(args=argv))  # type: ignore[call-arg]  # pydantic-settings' init keyword: mypy knows it only with pydantic's plugin
    except SettingsError as e:
        console.print(str(e), style="red")
        return 2
    except ValidationError as e:
        console.print("\n".join(f"field '{err['loc'][0]}': {err['msg']}" for err in e.errors()), style="red")
        return 2
    redis_pid = 0  # the embedded Redis's, for an `up` run's --workdir
    workdir = Path(args.workdir) if args.workdir else None
    if workdir is not None:  # the embedded Redis of an `up` run, as its admin user
        try:
            recorded = json.loads((workdir / "state" / "redis.json").read_text())
            args.redis_url, redis_pid = recorded["url"], int(recorded.get("pid", 0))
        except (OSError, ValueError, KeyError) as e:
            console.print(
                f"--workdir: no embedded Redis recorded in {workdir / 'state' / 'redis.json'} ({e})", style="red"
            )
            return 2
        args.redis_username = args.redis_username or redis_acl.ADMIN
        args.redis_password_file = args.redis_password_file or str(
            redis_acl.password_file(workdir / "credentials", redis_acl.ADMIN)
        )
    try:
        username, password = redis_policy.credentials(
            args.redis_url, args.redis_username, args.redis_password_file, args.redis_password.get_secret_value()
        )
    except ValueError as e:
        console.print(str(e), style="red")
        return 2
    keys = run_keys.RunKeys(args.run)
    thresholds = diagnose.Thresholds(idle_s=args.idle_s, max_staleness=args.max_staleness)
    if not console.is_terminal:
        console.width = max(console.width, 180)  # piped: no wrapping of the stream names
    client = None
    prev = None
    live = Live(console=console, auto_refresh=False, transient=False) if args.watch and console.is_terminal else None
    if args.watch:
        # Ctrl-C and SIGTERM end the watch. Said explicitly: a process started from a
        # non-interactive shell's background job inherits SIGINT ignored, and Python then
        # installs no KeyboardInterrupt handler (it watched on forever after a SIGINT).
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        if live is not None:
            live.start()
        while True:
            try:
                client = client or redis_policy.connect(args.redis_url, username, password)
                snap, extra = pipeline_status.collect(client, keys, workdir)
                view: RenderableType = pipeline_status.render(keys, snap, extra, prev, thresholds)
                prev = snap
            except redis_policy.ERRORS as e:
                view = Text(redis_down_line(args.redis_url, e, workdir, redis_pid), style="yellow")
                if not args.watch:
                    console.print(view)
                    return 1
            if live is not None:
                live.update(view, refresh=True)
            else:
                console.print(view)
            if not args.watch:
                return 0
            time.sleep(args.watch)
    except KeyboardInterrupt:
        return 0
    finally:
        if live is not None:
            live.stop()
        if client is not None:
            client.close()


def cmd_plot(args: argparse.Namespace) -> int:
    from rollstream.launcher import plot

    console = plain_console(stderr=True)
    run = Path(args.run)
    try:
        log_path = plot.resolve_log(run)
        out = Path(args.output) if args.output else (run if run.is_dir() else run.parent) / "curves.png"
        path, log = plot.render(log_path, out, title=args.title)
    except plot.PlotError as e:
        console.print(str(e), style="red", soft_wrap=True)
        return 1
    for number, why in log.skipped:
        console.print(f"warning: {log_path}:{number} skipped: {why}", style="yellow", soft_wrap=True)
    print(path)
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    """A checkpoint as a Hugging Face folder; 2 with the cause on bad input."""
    console = plain_console(stderr=True)
    try:
        from rollstream.trainer import export
    except ImportError as e:  # the launcher without its [up] extra
        console.print(
            f"rollstream export needs the trainer package (pip install 'rollstream-launcher[up]'): {e}", style="red"
        )
        return 2
    out = Path(args.out)
    try:
        path, notes = export.find_checkpoint(Path(args.run), args.step)
        for note in notes:
            console.print(f"warning: {note}", style="yellow", soft_wrap=True)
        export.check_output(out)  # before minutes of loading
        trained = export.from_checkpoint(path)
        written = export.export(trained, out, args.dtype, merge=args.merge)
    except export.ExportError as e:
        console.print(str(e), style="red", soft_wrap=True)
        return 2
    except KeyboardInterrupt:
        console.print(f"interrupted: nothing written to {out}", style="yellow")
        return 130
    print(
        f"exported step {trained.step} (version {trained.version}) of {path} as {args.dtype} to {written} ({export.folder_bytes(written) / 1e6:.1f} MB)"
    )
    return 0


def cmd_secrets(args: argparse.Namespace) -> int:
    root = Path(args.dir)
    if (args.namespace or args.dns) and not args.tls:
        print("--namespace and --dns name certificates: add --tls", file=sys.stderr)
        return 2
    credentials.ensure_grpc_tokens(root)
    redis_acl.ensure_redis_credentials(root, reference_stage=args.reference)
    if args.tls:
        credentials.ensure_tls(root, namespace=args.namespace, extra_names=tuple(args.dns))
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        print(path)
    return 0


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """--help shows every option's default after its help line, except an empty one (None, "",
    False, []): there the help line says what empty means."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        empty = (
            action.default is None or action.default is False or action.default == "" or action.default == []
        )  # 0 is a default
        if not action.option_strings or "%(default)" in text or empty or action.default is argparse.SUPPRESS:
            return text
        return f"{text} (default: %(default)s)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rollstream", description=__doc__, formatter_class=HelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    # Listed for --help; their flags are generated from settings classes (main_code).
    sub.add_parser("up", help="run the whole system locally (flags: rollstream up --help)", add_help=False)
    sub.add_parser(
        "eval",
        help="the held-out accuracy of a model or a run's exported model, through the same services (flags: rollstream eval --help)",
        add_help=False,
    )
    sub.add_parser(
        "sft",
        help="supervised fine-tuning of a model on a dataset, the model folder GRPO starts from (flags: rollstream sft --help)",
        add_help=False,
    )
    sub.add_parser(
        "config", help="print the run configuration `up` would use, with each value's source", add_help=False
    )
    sub.add_parser(
        "status",
        help="show a run's streams, consumer groups and counters (flags: rollstream status --help)",
        add_help=False,
    )
    pl = sub.add_parser(
        "plot",
        help="render a run's curves (reward, KL, tokens/s, staleness, delta size) as a PNG",
        formatter_class=HelpFormatter,
    )
    pl.add_argument("run", help=f"an `up` run folder (its {steplog.FILE_NAME}) or a step log file")
    pl.add_argument("-o", "--output", default="", help="the PNG (default: curves.png in the run folder)")
    pl.add_argument("--title", default="", help="the run's name in the title (default: from the log)")
    pl.set_defaults(func=cmd_plot)
    ex = sub.add_parser(
        "export",
        help="write a run's checkpoint as a Hugging Face folder (model or LoRA adapter, tokenizer)",
        formatter_class=HelpFormatter,
    )
    ex.add_argument("run", help="an `up` run folder (its checkpoints/), a checkpoint_dir, or one checkpoint folder")
    ex.add_argument(
        "--step", type=int, default=None, help="the checkpoint of this step (default: the latest whole one)"
    )
    ex.add_argument(
        "--dtype",
        choices=["bfloat16", "float32"],
        default="bfloat16",
        help="bfloat16: the weights the trainer served at that step, bit for bit; float32: its fp32 master weights",
    )
    ex.add_argument(
        "--merge",
        action="store_true",
        help="LoRA runs: the merged weights as a full model instead of the adapter folder",
    )
    ex.add_argument(
        "--out",
        required=True,
        help="the folder to write (new, empty, or an earlier export, which is replaced once the new one is whole)",
    )
    ex.set_defaults(func=cmd_export)
    se = sub.add_parser(
        "secrets",
        help="write a credentials folder for compose, Kubernetes or your own deployment",
        formatter_class=HelpFormatter,
    )
    se.add_argument("dir", help="the folder (created; existing secrets in it are kept: delete a file to rotate it)")
    se.add_argument("--tls", action="store_true", help="also a CA and a certificate per role (mTLS)")
    se.add_argument(
        "--reference",
        action="store_true",
        help="the deployment runs a reference stage (beta > 0): the reward's Redis user may not write ready (run it again without to drop one)",
    )
    se.add_argument(
        "--namespace", default="", help="with --tls: add the Kubernetes Service names <role>.<namespace>.svc"
    )
    se.add_argument(
        "--dns", action="append", default=[], help="with --tls: another name every certificate carries (repeatable)"
    )
    se.set_defaults(func=cmd_secrets)
    return parser


def main_code(argv: list[str] | None = None) -> int:
    """Run one command and return its exit status (for tests: main() exits with it)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    generated = {"up": cmd_up, "eval": cmd_eval, "sft": cmd_sft, "config": cmd_config, "status": cmd_status}
    if argv and argv[0] in generated:
        return generated[argv[0]](argv[1:])
    args = build_parser().parse_args(argv)
    return int(args.func(args))


def main(argv: list[str] | None = None) -> None:
    sys.exit(main_code(argv))


if __name__ == "__main__":
    main()
