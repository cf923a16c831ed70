"""Run an untrusted program against tests, in processes that cannot hurt the service and
cannot see what the tests expect.

`run_tests(code, tests, limits)` starts `python -I -S sandbox_harness.py job.json` and
waits at most `limits.wall_s`. The harness (trusted code, sandbox_harness.py beside this
module) first fences itself in, then runs each test in a fresh interpreter of its own,
judges it from the outside, and finally reports which tests passed on a pipe only it holds.

## Who holds what

- The harness holds the tests, with what they expect. It never runs the program's code.
  Once fenced in it makes itself non-dumpable (prctl PR_SET_DUMPABLE 0): a process of the
  same user without capabilities (the program) can then neither ptrace it nor read its
  /proc/PID/mem, environ or fd/ (the kernel's ptrace access check).
- Each test runs in a new process: forked from the harness, it sets up its file
  descriptors and execs a fresh `python -I -S -c RUNNER`, RUNNER being the text of
  sandbox_runner.py (nothing of the harness's memory survives execve). Its only inputs
  are fd 0 (the test's stdin: an io test's `input`, else empty), fd 3 (the program and the
  test's own steps, below; read and closed before the program runs), fd 1 (its stdout,
  read back by the harness), fd 4 (a pipe where RUNNER reports) and fd 2 (the service's
  stderr file). RUNNER writes "started" to fd 4, execs the program, then the test steps,
  and writes what it saw. Everything in that process is the program's to read and to
  forge: the verdict never rests on it alone (see the guarantees). What it wrote to the
  pipe it cannot take back, so a program cannot pass itself off as an interpreter that did
  not start (an error of the sandbox, not a 0).

## Tests

From the task's metadata_json, `{"tests": [...]}`, each either
- `{"input": "...", "output": "..."}`: the program runs as `__main__` with that stdin; the
  test passes when it ends by itself with exit status 0 (returning, `sys.exit(0)` or
  `os._exit(0)`), within the per-test limit, and its stdout equals `output` (trailing
  whitespace of each line and trailing blank lines ignored). The harness compares;
  `output` never enters the program's process.
- a string of Python run after the program in the same globals ("assert add(1, 2) == 3"),
  with `__name__` set to "solution" so a `__main__` block does not run. The harness parses
  it. A top-level `assert A <op> B` (one comparison: == != < <= > >= in, not in; `is` /
  `is not` against None, True or False) where one side uses only literals and a few pure
  builtins (`EXPECTED_BUILTINS`) and the other does not is *judged outside*: the harness
  evaluates the expected side itself; the program's process evaluates only the other side
  and sends back its value, which must be plain data (None, bool, int, float, complex,
  str, bytes, list, tuple, dict, set, frozenset, Fraction, Decimal, and dict for Counter,
  OrderedDict and defaultdict), else the test fails; the harness applies the comparison.
  Every other statement of the test (set-up, an assert of another shape, an assert inside
  a function or loop, `check(candidate)`) runs in the program's process, as before, and
  counts when RUNNER reports that the whole test ran to its end without an exception.

## What is guaranteed, and what is not

Guaranteed (given the isolation below held):
- An io test passes only if the program printed the expected output itself: the expected
  output is nowhere in its process, its memory, its files or its /proc; frames, gc,
  the harness's globals, /proc/self/mem and the harness's /proc/1/mem show nothing of it.
  Ending early, killing itself, patching print or sys.stdout, or writing to fd 1 early
  change only what it printed.
- A judged-outside assertion passes only if the value the program produced satisfies the
  comparison with an expected side the program never saw: forging RUNNER's reports, exiting
  early, objects with a rigged `__eq__`, or a redefined AssertionError cannot make it pass.
  Each judged assertion must report exactly once, in order, and the test must end with
  RUNNER's "done" and exit status 0.
- Hanging is a timeout (`RunResult.timeouts`), never a pass, and the code component
  reports it as status "timeout" with value 0.
- Nothing the program does makes another test pass (one process per test; the harness
  tells no process whether it passed).

Not guaranteed:
- Statements that run in the program's process are judged in that process: a program
  written against RUNNER (it can read RUNNER's source, and the test's code it is called
  from, e.g. through `sys._getframe(1)`) can make those statements look passed (forge
  RUNNER's reports on fd 4, rig `__eq__` on what it returns, trace hooks, ctypes). Write
  tests as top-level `assert call(...) == literal` to have them judged outside.
- What is on the program's side of a judged comparison is seen by the program: in
  `assert abs(f(x) - 1.5) < 1e-9` the 1.5 is in its process. Put the expected value alone
  on one side.
- Values that are not plain data (the program's own classes, deque, an int subclass)
  cannot be judged outside: such a test fails even where Python's `==` would have said yes.
- The expected side is evaluated with the builtins, not the program's names: a program
  that redefines `sorted` does not change `assert f(x) == sorted([2, 1])`.
- The program can guess; what the tests check is up to them.

## Isolation

- network: a new network namespace (no interfaces but a down loopback), plus a new PID
  namespace whose init is the harness, so every process the program starts dies with it,
  and a new IPC namespace (System V objects and POSIX message queues die with the run);
  as root these come from unshare(2), otherwise from an unprivileged user namespace;
- file system: a new mount namespace, cut off from the host's (private propagation), and
  in it a minimal root the harness chroots into (an allow-list, not a deny-list): /usr,
  /bin, /sbin, /lib* (links stay links), the interpreter's own prefix where /usr does not
  hold it (pyenv under a home folder), a few /etc files (the loader's cache, passwd,
  group, localtime, ...) and /dev/null, zero, full, random, urandom, all bound from the
  host; and, where one of those trees holds the service's work dir or home (a checkout
  under /usr/src), an empty folder over it. Nothing else of the host is there: no home,
  no work dir, no run data (the rollout buffer's AOF holds every test's expected output,
  and the service's user may read it whatever its mode). Every mount is read-only and
  nosuid; /tmp, /var/tmp and /dev/shm are fresh tmpfs (each at most twice `max_file_mb`,
  4096 files) that vanish with the run, and /tmp is the program's work dir (its files
  stay there from one test to the next); /proc is the new PID namespace's, so other
  processes (and, through /proc/PID/root, their file systems) are out of sight. The
  program cannot undo this: as `nobody` it has no capabilities, in a user namespace the
  harness drops them all, and a chrooted process may not make a user namespace of its
  own (EPERM). `RunResult.private_fs` says whether all of it held;
- user: as root it drops to `nobody` (65534): root's files are off limits and RLIMIT_NPROC
  (which root ignores) caps the processes, so a fork bomb stops at `max_processes`;
  without root the program runs as the service's own user (mapped to itself);
- rlimits: CPU seconds, address space, file size, open files, no core dumps;
- time: `test_timeout_s` per test (the harness kills the test's process group; a program
  killed by the CPU limit counts as timed out too), `wall_s` for the whole run (the
  service kills the process group; the PID namespace takes the rest with it).

Under Docker or Kubernetes the default seccomp profile refuses unshare(2) and mount(2):
docker/seccomp/reward.json is that profile plus what the harness needs (see its README).

The private file system is best effort, because `require_isolation` promises the
network and PID namespaces only, and a kernel that allows those but not the mounts
should not stop runs that worked before. Where a step fails, the run goes on with what
held and `private_fs` is False: no mount namespace at all; no minimal root (a mount or
chroot refused, as under a seccomp profile without chroot: then the host's whole tree,
read-only, with private temp dirs, and the program reads whatever its user may read,
run data included); a kernel before 5.12 (no mount_setattr: nothing is read-only, the
temp dirs are still private); a /proc the kernel will not mount again in a user
namespace (as in many containers, whose /proc is partly covered). What did not hold is
then guarded by the user alone, as before (as `nobody`, world-writable places stay
writable; without root, all of the service user's files are). A /tmp mount that fails
after the tree became read-only ends the run (no writable work dir). Not isolated even
with `private_fs`: the program reads what its user may read under the allowed trees
(/usr, the interpreter's prefix, the /etc files above); it writes the service's stderr
file through fd 2 (bounded by the file-size limit). Without root and without user namespaces there is no
isolation, and with `require_isolation` (the default) nothing runs. The per-test
interpreter must be reachable inside the fence (not under /tmp, which the private /tmp
hides): if it cannot start, run_tests raises SandboxUnavailable.

Cost: one interpreter start per test (`python -I -S`, about 15-25 ms), on top of the
harness's own start.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

# Standard library only (they run with -I -S); how each is run: sandbox_harness.py's docstring.
# Absolute: the harness starts in the run's work dir.
HARNESS_PATH = Path(__file__).resolve().with_name("sandbox_harness.py")
RUNNER_PATH = Path(__file__).resolve().with_name("sandbox_runner.py")
NOBODY = 65534
ISOLATION_UNAVAILABLE_EXIT = 121
# The harness could not start the per-test interpreter (it never reported in).
INTERPRETER_UNAVAILABLE_EXIT = 122
# Bytes of the program's stderr kept for the status line of a failed run.
STDERR_TAIL = 400
# How long a harness told to stop (SIGTERM) gets to end its namespace before SIGKILL.
STOP_GRACE_S = 2.0


class SandboxUnavailable(RuntimeError):
    """The sandbox cannot run anything here (no isolation, no usable interpreter)."""


@dataclass(frozen=True)
class SandboxLimits:
    wall_s: float = 10.0
    test_timeout_s: float = 5.0
    cpu_s: int = 10
    memory_mb: int = 512
    max_processes: int = 64
    max_file_mb: int = 16
    max_open_files: int = 64
    require_isolation: bool = True
    python: str = ""  # interpreter for the program; "" picks one the sandbox user can run


@dataclass(frozen=True)
class RunResult:
    passed: tuple[bool, ...]
    timed_out: bool  # the whole run hit wall_s (or the harness never reported)
    isolated: bool
    detail: str  # why tests failed, briefly (first failure), or the stderr tail
    # The program saw a read-only tree with private temp dirs and /proc (see the module
    # docstring); False when the kernel refused part of it, or without a report.
    private_fs: bool = False
    # Tests that ran past test_timeout_s (or were killed by the CPU limit); they are failed.
    timeouts: int = 0

    @property
    def fraction(self) -> float:
        return sum(self.passed) / len(self.passed) if self.passed else 0.0


def parse_tests(metadata: dict[str, object]) -> list[str | dict[str, str]]:
    """The `tests` list of a code task's metadata; ValueError says what is wrong."""
    tests = metadata.get("tests")
    if not isinstance(tests, list) or not tests:
        raise ValueError('metadata_json has no "tests" list (strings of Python, or {"input", "output"} objects)')
    for i, t in enumerate(tests):
        io_test = isinstance(t, dict) and isinstance(t.get("input", ""), str) and isinstance(t.get("output"), str)
        if not (isinstance(t, str) or io_test):
            raise ValueError(f"test {i} is neither a string of Python nor an {{input, output}} object")
    return tests


def _world_runnable(path: Path) -> bool:
    """Can a user with no special rights reach and run `path` (every directory above it
    searchable by others, the file readable and executable by others)?"""
    path = path.resolve()
    if not path.is_file() or (path.stat().st_mode & (stat.S_IROTH | stat.S_IXOTH)) != (stat.S_IROTH | stat.S_IXOTH):
        return False
    return all(p.stat().st_mode & stat.S_IXOTH for p in path.parents)


def choose_python(configured: str) -> str:
    """The interpreter the program runs with. As root the harness drops to `nobody` before
    the program imports anything, so the interpreter and its standard library must be
    readable by others: this service's own interpreter often is not (pyenv under /root),
    the system's /usr/bin/python3 usually is. Raises SandboxUnavailable if none fits."""
    if configured:
        return configured
    if os.geteuid() != 0:
        return sys.executable
    # Our own, where its standard library is reachable by others too.
    lib = Path(sys.base_prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    if (
        _world_runnable(Path(sys.executable))
        and lib.is_dir()
        and all(p.stat().st_mode & stat.S_IXOTH for p in [lib, *lib.parents])
    ):
        return sys.executable
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if _world_runnable(Path(candidate)):
            return candidate
    raise SandboxUnavailable(
        f"no Python interpreter the sandbox user can run ({sys.executable} is not readable by others); "
        "set the code component's `python` parameter"
    )


def unavailable(limits: SandboxLimits) -> str:
    """Why the sandbox cannot run here ("" when it can), from one trivial program."""
    try:
        run_tests("", ["assert True"], limits)
    except SandboxUnavailable as e:
        return str(e)
    return ""


def run_tests(code: str, tests: list[str | dict[str, str]], limits: SandboxLimits) -> RunResult:
    """Run `code` against `tests` in the sandbox. Never raises for anything the program
    does; raises SandboxUnavailable when the sandbox itself cannot run."""
    python = choose_python(limits.python)
    workdir = Path(tempfile.mkdtemp(prefix="rollstream-code-"))
    results_r, results_w = os.pipe()
    proc: subprocess.Popen[bytes] | None = None
    try:
        job = {
            "code": code,
            "tests": tests,
            "results_fd": results_w,
            "test_timeout_s": limits.test_timeout_s,
            "cpu_s": limits.cpu_s,
            "memory_bytes": limits.memory_mb * 1024 * 1024,
            "max_processes": limits.max_processes,
            "file_bytes": limits.max_file_mb * 1024 * 1024,
            "open_files": limits.max_open_files,
            "require_isolation": limits.require_isolation,
            "drop_to": NOBODY if os.geteuid() == 0 else -1,
            "runner": RUNNER_PATH.read_text(),
            # The harness mounts the program's root here (in its own mount namespace).
            "root": str(workdir / "root"),
            "hide": sorted({os.path.realpath(os.getcwd()), os.path.realpath(os.path.expanduser("~"))}),
        }
        (workdir / "root").mkdir()
        (workdir / "job.json").write_text(json.dumps(job))
        if os.geteuid() == 0:
            os.chown(workdir, NOBODY, NOBODY)  # the harness writes test inputs/outputs here as nobody
        stderr = (workdir / "stderr.txt").open("wb")
        start = time.monotonic()
        try:
            proc = subprocess.Popen(
                [python, "-I", "-S", str(HARNESS_PATH), str(workdir / "job.json")],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=stderr,
                pass_fds=(results_w,),
                cwd=workdir,
                env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
                start_new_session=True,  # its own process group: one killpg ends it all
            )
        except OSError as e:
            raise SandboxUnavailable(f"cannot start {python}: {e}") from None
        finally:
            stderr.close()
        os.close(results_w)
        results_w = -1
        report, timed_out = _read_until_eof(results_r, start + limits.wall_s)
        if timed_out:
            _stop(proc)
        else:
            try:
                proc.wait(timeout=max(0.1, start + limits.wall_s - time.monotonic()))
            except subprocess.TimeoutExpired:
                _stop(proc)
                timed_out = True
        tail = (workdir / "stderr.txt").read_bytes()[-STDERR_TAIL:].decode(errors="replace").strip()
        if proc.returncode == ISOLATION_UNAVAILABLE_EXIT and not report:
            raise SandboxUnavailable(tail or "network isolation is not available")
        if proc.returncode == INTERPRETER_UNAVAILABLE_EXIT and not report:
            raise SandboxUnavailable(tail or f"{python} does not start inside the sandbox")
        return _parse_report(report, len(tests), timed_out, tail)
    finally:
        if proc is not None and proc.poll() is None:
            _kill_group(proc)
        if results_w >= 0:
            os.close(results_w)
        os.close(results_r)
        shutil.rmtree(workdir, ignore_errors=True)


def _read_until_eof(fd: int, deadline: float) -> tuple[bytes, bool]:
    """Everything written to `fd` until every writer closed it; (data, True) at the deadline."""
    chunks: list[bytes] = []
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return b"".join(chunks), True
        ready, _, _ = select.select([fd], [], [], remaining)
        if not ready:
            continue
        chunk = os.read(fd, 65536)
        if not chunk:
            return b"".join(chunks), False
        chunks.append(chunk)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM first: the harness then kills its PID namespace and reaps its init (see
    sandbox_harness.py); whatever is left after a short grace is killed with the process group."""
    proc.terminate()
    try:
        proc.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        pass
    _kill_group(proc)


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _parse_report(report: bytes, n_tests: int, timed_out: bool, stderr_tail: str) -> RunResult:
    try:
        data = json.loads(report.decode())
        passed = tuple(bool(p) for p in data["passed"])
        if len(passed) != n_tests:
            raise ValueError("wrong number of results")
        return RunResult(
            passed=passed,
            timed_out=False,
            isolated=bool(data["isolated"]),
            detail=str(data.get("detail", ""))[:STDERR_TAIL],
            private_fs=data.get("fs_private") is True,
            timeouts=int(data.get("timeouts", 0)),
        )
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        # No report: killed at the wall limit, or the harness itself died.
        return RunResult(
            passed=(False,) * n_tests,
            timed_out=timed_out,
            isolated=False,
            detail=stderr_tail or "the harness did not report",
        )
