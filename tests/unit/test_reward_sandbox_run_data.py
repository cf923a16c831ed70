"""A judged program cannot read the run's data (issue 27, S5: a completion scored 1.0 by
reading the run's AOF, world-readable in a workdir outside /tmp, and printing its own io
test's expected output). The sandbox shows the program a minimal root (the interpreter,
/usr, a few /etc files, private temp dirs): a run's workdir (the default `runs/<run>` in
the checkout here), its AOF and checkpoints are not in it, whatever their modes, whether
the service runs as root (the program as nobody) or as the files' own user."""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_reward_sandbox import NOT_ROOT, _readable_by_others, _run_script

from rollstream.launcher.redis_server import EmbeddedRedis
from rollstream.reward import sandbox
from rollstream.reward.sandbox import SandboxLimits, run_tests

REPO = Path(__file__).resolve().parents[2]
# Generous: these tests check what the sandbox allows, not how fast; on a loaded 2-core machine
# a test's interpreter took over 5 s to start. The timeout tests set their own limits.
LIMITS = SandboxLimits(wall_s=240.0, test_timeout_s=60.0)
ANSWER = f"answer-{uuid.uuid4().hex}"
# Prints the first line holding the answer's prefix in any of `paths` (the program knows
# only where to look, and that answers start with "answer-"); an error for each path it
# cannot read, one line each, on stderr.
THIEF = (
    "import sys\n"
    "def steal(paths):\n"
    "    for path in paths:\n"
    "        try:\n"
    "            data = open(path, 'rb').read().decode(errors='replace')\n"
    "        except OSError as e:\n"
    "            sys.stderr.write('%s: %s\\n' % (path, type(e).__name__))\n"
    "            continue\n"
    "        for word in data.replace('\\n', ' ').split():\n"
    "            if 'answer-' in word:\n"
    "                return word[word.index('answer-'):][:39]\n"
    "    return ''\n"
)


@pytest.fixture
def run_dir() -> Iterator[Path]:
    """A run's workdir where `up` puts it by default: runs/<run> in the checkout, not under /tmp."""
    path = REPO / "runs" / f"sandbox-{uuid.uuid4().hex[:12]}"
    path.mkdir(parents=True)
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def plant_run_data(run_dir: Path) -> list[Path]:
    """The answer in a real AOF (an embedded redis-server's, a prompt task's metadata), and
    in files of both modes; the paths a program would try."""
    with EmbeddedRedis(run_dir / "redis") as server:
        client = server.admin_client()
        client.xadd("rs:{demo}:prompts", {"data": json.dumps({"tests": [{"input": "", "output": ANSWER}]}).encode()})
        client.close()
    aofs = [p for p in (run_dir / "redis").rglob("*") if p.is_file() and ".aof" in p.name]
    assert any(ANSWER.encode() in p.read_bytes() for p in aofs), aofs
    private, shared = run_dir / "private.txt", run_dir / "shared.txt"
    for path, mode in ((private, 0o600), (shared, 0o644)):
        path.write_text(f"expected output: {ANSWER}\n")
        path.chmod(mode)
    return [*aofs, private, shared]


def thief_tests(paths: list[Path]) -> tuple[str, list[str | dict[str, str]]]:
    code = THIEF + f"PATHS = {[str(p) for p in paths]!r}\nif __name__ == '__main__':\n    print(steal(PATHS))\n"
    tests: list[str | dict[str, str]] = [
        {"input": "", "output": ANSWER},  # the attack: print the io test's expected output
        f"assert steal(PATHS) == {ANSWER!r}",
        *(f"import os\nassert not os.path.exists({str(p)!r})" for p in paths),  # not even there
    ]
    return code, tests


def test_a_program_run_by_a_root_service_cannot_read_the_runs_data(run_dir: Path) -> None:
    code, tests = thief_tests(plant_run_data(run_dir))
    result = run_tests(code, tests, LIMITS)
    assert result.private_fs, result.detail
    assert result.passed == (False, False) + (True,) * (len(tests) - 2), result.detail
    # Normal programs still pass, io and assertion tests alike.
    add = "def add(a, b):\n    return a + b\nif __name__ == '__main__':\n    print(add(*map(int, input().split())))\n"
    assert run_tests(add, ["assert add(1, 2) == 3", {"input": "20 22\n", "output": "42"}], LIMITS).passed == (
        True,
        True,
    )


@pytest.mark.skipif(
    os.geteuid() != 0
    or not Path("/usr/bin/python3").exists()
    or not _readable_by_others(Path(sandbox.__file__).resolve()),
    reason="needs root (to start the service as nobody, owning the run's files), /usr/bin/python3 and the sandbox module readable by others",
)
def test_a_program_run_by_the_files_owner_cannot_read_the_runs_data(run_dir: Path) -> None:
    paths = plant_run_data(run_dir)
    for path in [run_dir, *run_dir.rglob("*")]:
        os.chown(path, 65534, 65534)  # the service's user owns the run: 0600 is no obstacle to it
    code, tests = thief_tests(paths)
    # The sandbox module run by a service that is not root, as the user that owns the run's
    # files, from the run's folder.
    report = _run_script(
        ["/usr/bin/python3", "-I", "-c", NOT_ROOT, str(Path(sandbox.__file__).resolve()), code, json.dumps(tests)],
        user=65534, group=65534, extra_groups=[], cwd=run_dir, env={"PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert report["private_fs"], report
    assert report["passed"] == [False, False] + [True] * (len(tests) - 2), report
