"""Reward stage throughput: groups/s of the `math` recipe (math-verify) with 1 and 2 workers.

    .venv/bin/python benchmarks/reward_throughput.py [--groups 400] [--group-size 8] [--workers 1,2] [--repeats 3] [--score-workers N]

Starts an embedded redis-server, then for each worker count: that many real
`python -m rollstream.reward` processes sharing one consumer group, all ready before any
group is written; writes every group in one pipeline and times until the last one is
in rs:<run>:scored. Completions are math answers of the kinds models write (boxed
fractions, decimals, LaTeX, wrong answers, no answer). The worker counts alternate,
`--repeats` rounds; each count reports its best and median round, and the workers' CPU
seconds (from /proc: each service process and its scoring pool's worker processes), which
other work on a shared machine disturbs less than wall time. `--score-workers`: each
service's pool size (default: the service's own default).
Prints one JSON object; results go to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from rollstream.core import validation
from rollstream.core.redis_policy import connect
from rollstream.core.run_keys import RunKeys
from rollstream.launcher.redis_server import EmbeddedRedis
from rollstream.v1 import rollout_pb2


def completion_texts(rng: random.Random, n: int) -> tuple[str, list[str]]:
    """A reference answer (a fraction) and n completions answering it in various ways."""
    a, b = rng.randint(1, 30), rng.randint(2, 30)
    value = a / b
    forms = [
        lambda: f"We simplify step by step. So the answer is $\\boxed{{\\frac{{{a}}}{{{b}}}}}$.",
        lambda: f"Dividing gives {value:.6f}, therefore \\boxed{{{value:.6f}}}",
        lambda: f"Let $x = \\frac{{{2 * a}}}{{{2 * b}}}$. Then $x = \\boxed{{\\dfrac{{{a}}}{{{b}}}}}$",
        lambda: f"The result is \\boxed{{\\frac{{{a + 1}}}{{{b}}}}}",  # wrong
        lambda: f"I think the answer is {a}/{b + 1}.",  # wrong, no box
        lambda: "I am not sure how to solve this problem.",  # no answer
        lambda: f"$$\\frac{{{a}}}{{{b}}} = \\frac{{{a * 3}}}{{{b * 3}}}$$ so \\boxed{{\\frac{{{a * 3}}}{{{b * 3}}}}}",
        lambda: f"Using $\\sqrt{{4}} = 2$, we get $\\boxed{{{a}/{b}}}$",
    ]
    return f"\\frac{{{a}}}{{{b}}}", [rng.choice(forms)() for _ in range(n)]


def make_groups(n_groups: int, group_size: int, seed: int) -> list[rollout_pb2.RolloutGroup]:
    rng = random.Random(seed)
    groups = []
    for i in range(n_groups):
        answer, texts = completion_texts(rng, group_size)
        groups.append(
            rollout_pb2.RolloutGroup(
                group_id=f"g{i}",
                task_id=f"g{i}",
                prompt_ids=[1, 2, 3],
                answer=answer,
                task_kind="math",
                completions=[
                    rollout_pb2.Completion(text=t, token_ids=[5] * 40, behaviour_logprobs=[-1.0] * 40) for t in texts
                ],
            )
        )
    return groups


def start_worker(
    redis_url: str, run: str, name: str, workdir: Path, extra: list[str]
) -> tuple[subprocess.Popen[bytes], Path]:
    state = workdir / f"{name}.json"
    log = (workdir / f"{name}.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "rollstream.reward", "--redis-url", redis_url, "--run", run, "--consumer", name,
         "--state-file", str(state), "--block-ms", "50", "--log-level", "WARNING", *extra],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    log.close()
    return proc, state


def wait_ready(proc: subprocess.Popen[bytes], state: Path, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"reward worker exited with {proc.returncode}")
        if state.exists():
            port = json.loads(state.read_text())["http_port"]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
        time.sleep(0.1)
    raise TimeoutError("reward worker not ready")


# A plain CPU-bound loop that reports the share of a core it got (CPU time / wall time).
_SPIN = "import time\nt, c = time.perf_counter(), time.process_time()\nwhile time.perf_counter() - t < 2: pass\nprint((time.process_time() - c) / (time.perf_counter() - t))"


def free_cores(n: int) -> float:
    """How many cores n busy processes get together right now: on a machine shared with
    other work this, not os.cpu_count(), bounds what n workers can add."""
    procs = [subprocess.Popen([sys.executable, "-c", _SPIN], stdout=subprocess.PIPE, text=True) for _ in range(n)]
    return round(sum(float(p.communicate()[0]) for p in procs), 2)


def _stat(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def descendants(pid: int) -> list[int]:
    """pid and every process below it (a service's forkserver and its scoring workers)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parents[int(stat.parent.name)] = int(_stat(int(stat.parent.name))[1])
        except (OSError, ValueError, IndexError):
            continue
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        todo.extend(c for c, parent in parents.items() if parent == p)
    return found


def cpu_seconds(pid: int) -> float:
    """User + system CPU time so far (fields 14 and 15 of /proc/<pid>/stat) of a process and
    its descendants (those still alive)."""
    total = 0
    for p in descendants(pid):
        try:
            fields = _stat(p)
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def measure(
    redis_url: str, workers: int, groups: list[rollout_pb2.RolloutGroup], workdir: Path, round_: int, extra: list[str]
) -> dict[str, float]:
    run = f"bench-reward-{workers}w-{round_}-{int(time.time())}"
    keys = RunKeys(run)
    client = connect(redis_url)
    procs = [start_worker(redis_url, run, f"w{i}", workdir, extra) for i in range(workers)]
    try:
        for proc, state in procs:
            wait_ready(proc, state)
        cpu_before = sum(cpu_seconds(proc.pid) for proc, _ in procs)
        start = time.perf_counter()
        pipe = client.pipeline(transaction=False)
        for g in groups:
            pipe.xadd(keys.stream("rollouts"), validation.encode(g))
        pipe.execute()
        while client.xlen(keys.stream("scored")) < len(groups):
            time.sleep(0.01)
        seconds = time.perf_counter() - start
        cpu = sum(cpu_seconds(proc.pid) for proc, _ in procs) - cpu_before
        stats = {k.decode(): int(v) for k, v in client.hgetall(keys.stats).items()}
    finally:
        for proc, _ in procs:
            proc.send_signal(signal.SIGTERM)
        for proc, _ in procs:
            proc.wait(timeout=30)
        client.close()
    completions = sum(len(g.completions) for g in groups)
    return {
        "workers": workers,
        "groups": len(groups),
        "seconds": round(seconds, 3),
        "groups_per_s": round(len(groups) / seconds, 2),
        "completions_per_s": round(completions / seconds, 1),
        "cpu_seconds": round(cpu, 2),
        "completions_per_cpu_s": round(completions / cpu, 1),
        "timeouts": stats.get("reward_timeouts", 0),
        "verifier_errors": stats.get("reward_verifier_errors", 0),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, default=400)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--workers", default="1,2", help="comma-separated worker counts")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--score-workers", type=int, default=0, help="each service's scoring pool size (0: the service's default)"
    )
    args = parser.parse_args()
    extra = ["--score-workers", str(args.score_workers)] if args.score_workers else []
    groups = make_groups(args.groups, args.group_size, args.seed)
    counts = [int(w) for w in args.workers.split(",")]
    rounds: dict[int, list[dict[str, float]]] = {w: [] for w in counts}
    with tempfile.TemporaryDirectory() as tmp, EmbeddedRedis(Path(tmp) / "redis", appendonly=False) as server:
        for r in range(args.repeats):
            for w in counts:
                rounds[w].append(measure(server.url, w, groups, Path(tmp), r, extra))
    probe = {f"{n}_spinners": free_cores(n) for n in counts}
    results = []
    for w in counts:
        best = max(rounds[w], key=lambda x: x["groups_per_s"])
        results.append(
            {
                **best,
                "median_groups_per_s": statistics.median(x["groups_per_s"] for x in rounds[w]),
                "rounds": [x["groups_per_s"] for x in rounds[w]],
            }
        )
    out = {
        "benchmark": "reward_throughput",
        "recipe": "math (math-verify)",
        "group_size": args.group_size,
        "score_workers": args.score_workers or "default",
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "load_average": [round(x, 2) for x in os.getloadavg()],  # other work on the machine skews the figures
        "free_cores_after": probe,
        "results": results,
    }
    if len(results) > 1:
        out["speedup_best"] = round(results[-1]["groups_per_s"] / results[0]["groups_per_s"], 2)
        out["speedup_median"] = round(results[-1]["median_groups_per_s"] / results[0]["median_groups_per_s"], 2)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
