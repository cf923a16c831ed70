"""Run an untrusted program against tests, in processes that cannot hurt the service and
cannot see what the tests expect.

`run_tests(code, tests, limits)` starts `python -I -S -c HARNESS job.json` and waits at
most `limits.wall_s`. The harness (trusted code, below) first fences itself in, then runs
each test in a fresh interpreter of its own, judges it from the outside, and finally
reports which tests passed on a pipe only it holds.

## Who holds what

- The harness holds the tests, with what they expect. It never runs the program's code.
  Once fenced in it makes itself non-dumpable (prctl PR_SET_DUMPABLE 0): a process of the
  same user without capabilities (the program) can then neither ptrace it nor read its
  /proc/PID/mem, environ or fd/ (the kernel's ptrace access check).
- Each test runs in a new process: forked from the harness, it sets up its file
  descriptors and execs a fresh `python -I -S -c RUNNER` (nothing of the harness's memory
  survives execve). Its only inputs are fd 0 (the test's stdin: an io test's `input`, else
  empty), fd 3 (the program and the test's own steps, below; read and closed before the
  program runs), fd 1 (its stdout, read back by the harness), fd 4 (a pipe where RUNNER
  reports) and fd 2 (the service's stderr file). RUNNER writes "started" to fd 4, execs the
  program, then the test steps, and writes what it saw. Everything in that process is the
  program's to read and to forge: the verdict never rests on it alone (see the
  guarantees). What it wrote to the pipe it cannot take back, so a program cannot pass
  itself off as an interpreter that did not start (an error of the sandbox, not a 0).

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

## Isolation (unchanged)

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
        if isinstance(t, str):
            continue
        if isinstance(t, dict) and isinstance(t.get("input", ""), str) and isinstance(t.get("output"), str):
            continue
        raise ValueError(f"test {i} is neither a string of Python nor an {{input, output}} object")
    return tests  # type: ignore[return-value]


def _world_runnable(path: Path) -> bool:
    """Can a user with no special rights reach and run `path` (every directory above it
    searchable by others, the file readable and executable by others)?"""
    path = path.resolve()
    if not path.is_file() or (path.stat().st_mode & (stat.S_IROTH | stat.S_IXOTH)) != (stat.S_IROTH | stat.S_IXOTH):
        return False
    return all(p.stat().st_mode & stat.S_IXOTH for p in path.parents)


def _stdlib_world_readable(python: Path) -> bool:
    """For our own interpreter: is its standard library reachable by others too?"""
    lib = Path(sys.base_prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    return python.resolve() == Path(sys.executable).resolve() and lib.is_dir() and all(p.stat().st_mode & stat.S_IXOTH for p in [lib, *lib.parents])


def choose_python(configured: str) -> str:
    """The interpreter the program runs with. As root the harness drops to `nobody` before
    the program imports anything, so the interpreter and its standard library must be
    readable by others: this service's own interpreter often is not (pyenv under /root),
    the system's /usr/bin/python3 usually is. Raises SandboxUnavailable if none fits."""
    if configured:
        return configured
    if os.geteuid() != 0:
        return sys.executable
    own = Path(sys.executable)
    if _world_runnable(own) and _stdlib_world_readable(own):
        return sys.executable
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if _world_runnable(Path(candidate)):
            return candidate
    raise SandboxUnavailable(
        f"no Python interpreter the sandbox user can run ({sys.executable} is not readable by others); "
        "set the code component's `python` parameter"
    )


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
            "runner": RUNNER,
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
                [python, "-I", "-S", "-c", HARNESS, str(workdir / "job.json")],
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
    HARNESS); whatever is left after a short grace is killed with the process group."""
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
        return RunResult(passed=(False,) * n_tests, timed_out=timed_out, isolated=False, detail=stderr_tail or "the harness did not report")


# The harness. It runs with -I -S (no environment, no site-packages) and uses only the
# standard library. It never runs the program: each test is a fresh interpreter running
# RUNNER (below), started by `spawn` with nothing but the fds it needs.
HARNESS = r'''
import ast, ctypes, fcntl, json, marshal, operator, os, resource, select, signal, sys, time

job = json.load(open(sys.argv[1]))
os.unlink(sys.argv[1])  # it holds the expected outputs: the program must not read them
results_fd = job["results_fd"]
os.set_inheritable(results_fd, False)  # never passed on to a test's interpreter (see spawn)
libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWNET, CLONE_NEWPID, CLONE_NEWUSER = 0x00020000, 0x08000000, 0x40000000, 0x20000000, 0x10000000
PR_SET_PDEATHSIG, PR_SET_DUMPABLE = 1, 4
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_BIND, MS_REC, MS_PRIVATE = 0x1, 0x2, 0x4, 0x8, 0x1000, 0x4000, 0x40000
MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID = 0x1, 0x2
AT_FDCWD, AT_RECURSIVE = -100, 0x8000
SYS_MOUNT_SETATTR = 442  # Linux 5.12; new system calls have one number on x86-64 and arm64 alike
LINUX_CAPABILITY_VERSION_3 = 0x20080522
# Each private temp dir holds one test's input and output at the file-size limit; the
# inode cap keeps a program from filling kernel memory with empty files.
TMPFS_OPTIONS = "size=%d,nr_inodes=4096,mode=1777" % (2 * job["file_bytes"])


class MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64), ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]


def mount(source, target, fstype, flags, data):
    if libc.mount(source, target.encode(), fstype, ctypes.c_ulong(flags), data) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, "mount %s: %s" % (target, os.strerror(errno)))


def mount_tmpfs(target):
    mount(b"tmpfs", target, b"tmpfs", MS_NOSUID | MS_NODEV, TMPFS_OPTIONS.encode())


def make_mounts_private(in_user_ns, uid, gid):
    """Returns "" when this mount namespace is cut off from the host's, else what failed."""
    try:
        if in_user_ns:
            # Without a uid/gid map a new tmpfs refuses to create files (EOVERFLOW). We
            # keep our own ids; "deny" (no setgroups) is the price of mapping the gid.
            for name, text in (("setgroups", "deny"), ("uid_map", "%d %d 1" % (uid, uid)), ("gid_map", "%d %d 1" % (gid, gid))):
                with open("/proc/self/" + name, "w") as f:
                    f.write(text)
        # On a host whose mounts are shared, what we mount below would otherwise appear
        # in the host's namespace too.
        mount(None, "/", None, MS_REC | MS_PRIVATE, None)
    except OSError as e:
        return str(e)
    return ""


# The minimal root (tmpfs) the program sees instead of the host's tree: these, read-only, and
# nothing else of the host (no home, no work dir, no run data: the rollout buffer's AOF,
# checkpoints, credentials). Top-level entries that are links (merged /usr) stay links.
ALLOWED_TREES = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
ALLOWED_ETC = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "alternatives", "localtime", "os-release", "passwd", "group", "nsswitch.conf")
ALLOWED_DEV = ("null", "zero", "full", "random", "urandom")
ROOT_OPTIONS = b"size=1m,nr_inodes=1024,mode=755"


def bind(source, target):
    """`source` (a folder or a file) at `target` (made here: a folder or an empty file)."""
    if os.path.isdir(source):
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        open(target, "w").close()
    mount(source.encode(), target, None, MS_BIND | MS_REC, None)


def copy_entry(source, root):
    """Link, folder or file `source` into `root` (under the same path)."""
    target = root + source
    if os.path.islink(source):
        os.makedirs(os.path.dirname(target), exist_ok=True)
        os.symlink(os.readlink(source), target)
    elif os.path.exists(source):
        bind(source, target)


def python_trees():
    """The folders the interpreter needs (its prefix: binary and standard library) that the
    allowed trees do not hold already (pyenv under a home folder)."""
    needed = {os.path.realpath(p) for p in (sys.base_prefix, sys.base_exec_prefix, os.path.dirname(os.path.realpath(sys.executable)))}
    held = [os.path.realpath(t) for t in ALLOWED_TREES if os.path.isdir(t)]
    return sorted(p for p in needed if not any(p == h or p.startswith(h + "/") for h in held))


def build_root(root):
    """A read-only tree at `root` with only what a Python program needs; private temp dirs."""
    mount(b"tmpfs", root, b"tmpfs", MS_NOSUID | MS_NODEV, ROOT_OPTIONS)
    trees = python_trees()
    for entry in ALLOWED_TREES + tuple("/etc/" + name for name in ALLOWED_ETC):
        copy_entry(entry, root)
    for tree in trees:
        bind(tree, root + tree)
    for name in ALLOWED_DEV:
        if os.path.exists("/dev/" + name):
            bind("/dev/" + name, root + "/dev/" + name)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")):
        os.makedirs(root + "/dev", exist_ok=True)
        os.symlink(target, root + "/dev/" + name)
    for folder in ("/tmp", "/var/tmp", "/dev/shm", "/proc"):
        os.makedirs(root + folder, exist_ok=True)
    # The service's own folders (its work dir, its home) hidden where an allowed tree holds
    # them (a checkout under /usr/src), unless the interpreter lives there.
    for folder in job["hide"]:
        if folder != "/" and os.path.isdir(root + folder) and not any(t == folder or t.startswith(folder + "/") for t in trees):
            mount(b"tmpfs", root + folder, b"tmpfs", MS_NOSUID | MS_NODEV, b"size=4k,nr_inodes=1,mode=555")


def private_fs():
    """The program's file system: the minimal root (build_root) where it can be made, else
    the host's tree; either read-only and nosuid, with fresh tmpfs temp dirs and /tmp as the
    work dir. Returns "" when the minimal root and all the rest are in place, else what
    failed. Only a failed /tmp mount after the tree became read-only would leave no
    writable work dir, and then nothing can run (exit)."""
    if not os.path.isdir("/tmp"):
        return "no /tmp to hold the work dir"
    root = os.path.abspath(job["root"])
    try:
        build_root(root)
        why = enclose(root)
        # The host's tree stays mounted but out of reach: the program has no capabilities,
        # and a chrooted process may not make a user namespace to get some back.
        os.chroot(root)
    except OSError as e:
        # Not here (no chroot under a container's seccomp profile, a mount refused): the
        # host's tree, read-only, as on kernels without the minimal root.
        return "minimal root: %s; %s" % (e, enclose("/") or "the host's tree read-only instead")
    os.chdir("/tmp")
    return why


def enclose(root):
    """The tree at `root` read-only and nosuid, fresh tmpfs over its temp dirs, /tmp the
    work dir (chdir). What failed, or ""."""
    why = ""
    attr = MountAttr(attr_set=MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID)
    if libc.syscall(SYS_MOUNT_SETATTR, AT_FDCWD, root.encode(), AT_RECURSIVE, ctypes.byref(attr), ctypes.c_size_t(ctypes.sizeof(attr))) != 0:
        why = "mount_setattr (read-only tree): %s" % os.strerror(ctypes.get_errno())
    top = root.rstrip("/")
    try:
        mount_tmpfs(top + "/tmp")
    except OSError as e:
        if not why:
            sys.stderr.write("private file system: %s after the tree became read-only; no writable work dir\n" % e)
            sys.stderr.flush()
            os._exit(1)
        return "%s; %s" % (why, e)
    os.chdir(top + "/tmp")
    for target in ("/var/tmp", "/dev/shm"):
        if os.path.isdir(top + target):
            try:
                mount_tmpfs(top + target)
            except OSError as e:
                why = why or str(e)  # read-only (if the tree is) but the host's files stay visible
    return why


def drop_capabilities():
    """As root setuid(nobody) has already cleared them; in a user namespace the harness
    holds all of them, and with CAP_SYS_ADMIN the program could unmount what hides /tmp."""
    header = (ctypes.c_uint32 * 2)(LINUX_CAPABILITY_VERSION_3, 0)
    data = (ctypes.c_uint32 * 6)()  # effective, permitted, inheritable, for two 32-bit words: all empty
    if libc.capset(header, data) != 0:
        return "capset: %s" % os.strerror(ctypes.get_errno())
    return ""


in_user_ns = os.geteuid() != 0
uid, gid = os.geteuid(), os.getegid()
# IPC too: System V objects and POSIX message queues would otherwise be the host's and outlive the run.
flags = CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | (CLONE_NEWUSER if in_user_ns else 0)
isolated = libc.unshare(flags | CLONE_NEWNS) == 0
has_mount_ns = isolated
if not isolated:
    isolated = libc.unshare(flags) == 0  # no mount namespace here: keep the rest of the isolation
if not isolated and job["require_isolation"]:
    sys.stderr.write("network isolation unavailable: unshare failed with errno %d (%s)\n" % (ctypes.get_errno(), os.strerror(ctypes.get_errno())))
    sys.stderr.flush()
    os._exit(121)
mounts_private = False
fs_why = "no mount namespace"
if has_mount_ns:
    fs_why = make_mounts_private(in_user_ns, uid, gid)
    mounts_private = not fs_why
    if mounts_private:
        fs_why = private_fs()
if isolated:
    # The new PID namespace applies to children: fork, and let the child be its init.
    # The parent only waits; if it is killed, PDEATHSIG kills the init, and the kernel
    # kills everything else in the namespace.
    child = os.fork()
    if child:
        os.close(results_fd)
        # SIGTERM (the service's wall-clock limit): kill the namespace's init and reap it
        # here, rather than leave an orphan for a PID 1 that may never reap it.
        signal.signal(signal.SIGTERM, lambda signum, frame: os.kill(child, signal.SIGKILL))
        libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)  # it holds the job too (see below)
        _, status = os.waitpid(child, 0)
        os._exit(os.waitstatus_to_exitcode(status) & 0xFF)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if mounts_private:
        # A /proc of the new PID namespace (only its init can mount one): the host's shows
        # every process, and /proc/PID/root of one running as our user is its whole file system.
        try:
            mount(b"proc", "/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_RDONLY, None)
        except OSError as e:
            fs_why = fs_why or str(e)

if job["drop_to"] >= 0:
    os.setgroups([])
    os.setgid(job["drop_to"])
    os.setuid(job["drop_to"])
caps_why = drop_capabilities()
fs_why = fs_why or caps_why
# The tests' processes run as this same user: non-dumpable, the harness is out of their
# reach (no ptrace, no /proc/1/mem, environ or fd/). Only now: a non-dumpable process could
# not have written its own uid_map above (its /proc files belong to the global root).
if libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
    sys.stderr.write("prctl(PR_SET_DUMPABLE): %s\n" % os.strerror(ctypes.get_errno()))
    sys.stderr.flush()
    os._exit(1)
if fs_why:
    sys.stderr.write("private file system not in place: %s\n" % fs_why)
    sys.stderr.flush()
cpu = job["cpu_s"]
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
resource.setrlimit(resource.RLIMIT_AS, (job["memory_bytes"], job["memory_bytes"]))
resource.setrlimit(resource.RLIMIT_NPROC, (job["max_processes"], job["max_processes"]))
resource.setrlimit(resource.RLIMIT_FSIZE, (job["file_bytes"], job["file_bytes"]))
resource.setrlimit(resource.RLIMIT_NOFILE, (job["open_files"], job["open_files"]))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
# A file larger than the file-size limit (a huge test input) fails the write, rather than
# kill the harness; the tests' processes get the default back before they exec.
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
code = job["code"]
# By its real path: a venv's link is outside the minimal root (-I -S: no site-packages anyway).
PYTHON = os.path.realpath(sys.executable)
RUNNER = job["runner"]
OPEN_FILES = job["open_files"]
# Names the expected side of a judged assertion may use (pure functions of their arguments).
EXPECTED_BUILTINS = {
    name: getattr(__builtins__, name) if not isinstance(__builtins__, dict) else __builtins__[name]
    for name in (
        "abs", "all", "any", "bool", "bytes", "chr", "complex", "dict", "divmod", "enumerate", "filter", "float",
        "frozenset", "int", "len", "list", "map", "max", "min", "ord", "pow", "range", "reversed", "round",
        "set", "sorted", "str", "sum", "tuple", "zip",
    )
}
COMPARISONS = {
    ast.Eq: ("==", operator.eq), ast.NotEq: ("!=", operator.ne), ast.Lt: ("<", operator.lt), ast.LtE: ("<=", operator.le),
    ast.Gt: (">", operator.gt), ast.GtE: (">=", operator.ge), ast.In: ("in", lambda a, b: a in b),
    ast.NotIn: ("not in", lambda a, b: a not in b), ast.Is: ("is", operator.is_), ast.IsNot: ("is not", operator.is_not),
}
NO_VALUE = object()


def normalise(text):
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return "\n".join(lines)


def free_names(node):
    """Names an expression reads that it does not bind itself (comprehension targets,
    lambda arguments, := targets); a superset is fine: it only sends more to the program."""
    loaded, bound = set(), set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            (loaded if isinstance(n.ctx, ast.Load) else bound).add(n.id)
        elif isinstance(n, ast.arg):
            bound.add(n.arg)
    return loaded - bound


def expected_value(node):
    """The value of an expression the harness may evaluate itself (literals and
    EXPECTED_BUILTINS only), or NO_VALUE."""
    if not free_names(node) <= EXPECTED_BUILTINS.keys():
        return NO_VALUE
    try:
        return eval(compile(ast.Expression(body=node), "<expected>", "eval"), {"__builtins__": dict(EXPECTED_BUILTINS)})
    except BaseException:
        return NO_VALUE  # left to the program's process, where it fails as it would have


def judged_outside(stmt, source):
    """For `assert A <op> B` with one side the harness can evaluate and the other not:
    (source of the program's side, (op name, compare, expected value, program side is left)).
    None for any other statement."""
    if not isinstance(stmt, ast.Assert) or not isinstance(stmt.test, ast.Compare) or len(stmt.test.ops) != 1:
        return None
    op = COMPARISONS.get(type(stmt.test.ops[0]))
    if op is None:
        return None
    left, right = stmt.test.left, stmt.test.comparators[0]
    left_names, right_names = free_names(left), free_names(right)
    if not left_names <= EXPECTED_BUILTINS.keys() and right_names <= EXPECTED_BUILTINS.keys():
        program, expected, program_left = left, right, True
    elif not right_names <= EXPECTED_BUILTINS.keys() and left_names <= EXPECTED_BUILTINS.keys():
        program, expected, program_left = right, left, False
    else:
        return None
    if op[0] in ("is", "is not") and not (isinstance(expected, ast.Constant) and expected.value in (None, True, False) and type(expected.value) in (type(None), bool)):
        return None
    value = expected_value(expected)
    if value is NO_VALUE:
        return None
    text = ast.get_source_segment(source, program)
    text = "(\n%s\n)" % text if text is not None else ast.unparse(program)
    return text, (op[0], op[1], value, program_left)


def plan(test):
    """An assertion test as RUNNER's steps, and what the harness expects of each judged
    assertion. Steps: ("x", source) runs in the program's process; ("r", source, k)
    evaluates the program's side of judged assertion k there and reports its value."""
    try:
        tree = ast.parse(test)
    except (SyntaxError, ValueError):
        return [("x", test)], []  # fails there, with the error in the detail
    judged = [judged_outside(stmt, test) for stmt in tree.body]
    if not any(judged):
        return [("x", test)], []
    steps, expected, pending = [], [], []
    for stmt, j in zip(tree.body, judged):
        if j is None:
            pending.append(ast.unparse(stmt))
            continue
        if pending:
            steps.append(("x", "\n".join(pending)))
            pending = []
        steps.append(("r", j[0], len(expected)))
        expected.append(j[1])
    if pending:
        steps.append(("x", "\n".join(pending)))
    return steps, expected


def decode(item, depth=0):
    """A value as RUNNER encodes it (tagged lists of hex strings), rebuilt from plain types;
    ValueError (or TypeError, KeyError, ...) for anything else."""
    if depth > 200 or not isinstance(item, list) or not item or not isinstance(item[0], str):
        raise ValueError("malformed value")
    tag, rest = item[0], item[1:]
    if tag == "n":
        return None
    if tag == "b":
        return {"0": False, "1": True}[rest[0]]
    if tag == "i":
        return int(rest[0], 16)
    if tag == "f":
        return float.fromhex(rest[0])
    if tag == "c":
        return complex(float.fromhex(rest[0]), float.fromhex(rest[1]))
    if tag == "s":
        return bytes.fromhex(rest[0]).decode("utf-8", "surrogatepass")
    if tag == "y":
        return bytes.fromhex(rest[0])
    if tag == "q":
        from fractions import Fraction
        return Fraction(int(rest[0], 16), int(rest[1], 16))
    if tag == "D":
        from decimal import Decimal
        return Decimal(bytes.fromhex(rest[0]).decode("ascii"))
    items = rest[0]
    if not isinstance(items, list):
        raise ValueError("malformed value")
    if tag == "d":
        return {decode(k, depth + 1): decode(v, depth + 1) for k, v in items}
    values = [decode(v, depth + 1) for v in items]
    return {"l": list, "t": tuple, "S": set, "F": frozenset}[tag](values)


def short(value):
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def scratch(data=b""):
    """A file only the process that holds its descriptor sees: a memfd, else an unlinked
    file in the work dir."""
    try:
        fd = os.memfd_create("rollstream-test")
    except (AttributeError, OSError):
        name = ".rollstream-%s" % os.urandom(8).hex()
        fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.unlink(name)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.lseek(fd, 0, os.SEEK_SET)
    except OSError:
        os.close(fd)
        raise
    return fd


def read_back(fd, limit):
    chunks, offset = [], 0
    while offset <= limit:
        chunk = os.pread(fd, 1 << 20, offset)
        if not chunk:
            break
        chunks.append(chunk)
        offset += len(chunk)
    return b"".join(chunks)[: limit + 1]


def spawn(fds):
    """A fresh interpreter running RUNNER with fds[i] as its fd i (0-4), and no other."""
    pid = os.fork()
    if pid:
        return pid
    try:
        if isolated:
            os.setpgid(0, 0)  # so the harness can kill what the test started (the namespace ends the rest)
        high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 10) for fd in fds]
        for target, fd in enumerate(high):
            os.dup2(fd, target)
        os.closerange(len(fds), max(OPEN_FILES, results_fd + 1, 256))
        signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
        os.execv(PYTHON, [PYTHON, "-I", "-S", "-c", RUNNER])
    except BaseException as e:
        try:
            os.write(2, ("cannot start %s: %s\n" % (PYTHON, e)).encode(errors="replace"))
        except BaseException:
            pass
    os._exit(127)


def drain(fd, chunks, limit):
    """Appends what can be read from `fd` now (non-blocking) to `chunks`, at most a little
    past `limit` bytes in all; True at end of file."""
    size = sum(len(c) for c in chunks)
    while size <= limit:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            return False
        if not chunk:
            return True
        chunks.append(chunk)
        size += len(chunk)
    return False


def watch(pid, report_fd, timeout, limit):
    """Reads the test's reports while it runs, until it ends (left a zombie, so that its
    process group is still there to kill), `timeout` passes, or it wrote more than `limit`.
    (ended, report bytes)."""
    try:
        pidfd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        pidfd = -1  # polled instead
    os.set_blocking(report_fd, False)
    chunks, at_eof, ended, pause = [], False, False, 0.001
    deadline = time.monotonic() + timeout
    try:
        while True:
            if pidfd < 0 and os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                ended = True
            remaining = deadline - time.monotonic()
            if ended or remaining <= 0 or sum(len(c) for c in chunks) > limit:
                break
            fds = ([pidfd] if pidfd >= 0 else []) + ([] if at_eof else [report_fd])
            ready = select.select(fds, [], [], remaining if pidfd >= 0 else min(remaining, pause))[0]
            pause = min(pause * 2, 0.02)
            if pidfd >= 0 and pidfd in ready:
                ended = True
            if report_fd in ready:
                at_eof = drain(report_fd, chunks, limit)
    finally:
        if pidfd >= 0:
            os.close(pidfd)
    return ended, chunks


def run_one(index, test):
    """(passed, timed out, why it failed)."""
    io_test = isinstance(test, dict)
    if io_test:
        steps, expected = [], []
    else:
        steps, expected = plan(test)
    limit = job["file_bytes"]
    fds, report_r = [], -1
    try:
        try:
            fds.append(scratch(test.get("input", "").encode() if io_test else b""))
        except OSError as e:
            return False, False, "test %d: its input cannot be given to the program: %s" % (index, e)
        # Reports go through a pipe: what RUNNER wrote there, the program cannot take back.
        report_r, report_w = os.pipe()
        fds += [scratch(), 2, scratch(marshal.dumps({"io": io_test, "code": code, "steps": steps, "index": index})), report_w]
        pid = spawn(fds)
        for position in (0, 3, 4):
            os.close(fds[position])  # the program's own now
            fds[position] = -1
        ended, chunks = watch(pid, report_r, job["test_timeout_s"], limit)
        try:
            if isolated:
                os.killpg(pid, signal.SIGKILL)
            else:
                os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
        _, status = os.waitpid(pid, 0)
        drain(report_r, chunks, limit)  # what it wrote just before it ended
        output, report = read_back(fds[1], limit), b"".join(chunks)
    finally:
        for fd in fds + [report_r]:
            if fd > 2:
                os.close(fd)
    lines = report.split(b"\n")
    cpu_killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGXCPU
    if lines[:1] != [b'["h"]'] and ended and not cpu_killed:
        # RUNNER writes this before the program runs: the interpreter itself did not start.
        sys.stderr.write("test %d: %s did not start inside the sandbox (exit status %d)\n" % (index, PYTHON, os.waitstatus_to_exitcode(status)))
        sys.stderr.flush()
        os._exit(122)
    if len(report) > limit:
        return False, False, "test %d: reported more than the file-size limit" % index
    if not ended or cpu_killed:
        why = "timed out after %ss" % job["test_timeout_s"] if not ended else "ran past the CPU limit (%ss)" % job["cpu_s"]
        return False, True, "test %d: %s" % (index, why)
    try:
        events = [json.loads(line) for line in lines[1:] if line]
    except ValueError:
        return False, False, "test %d: unreadable report" % index
    for event in events:
        if isinstance(event, list) and event[:1] == ["e"] and len(event) == 2 and isinstance(event[1], str):
            try:
                text = bytes.fromhex(event[1]).decode(errors="replace")
            except ValueError:
                text = "?"
            return False, False, "test %d: %s" % (index, text[:200])
    if os.waitstatus_to_exitcode(status) != 0:
        return False, False, "test %d: did not finish (exit status %d)" % (index, os.waitstatus_to_exitcode(status))
    if io_test:
        if len(output) > limit:
            return False, False, "test %d: output past the file-size limit" % index
        if normalise(output.decode(errors="replace")) != normalise(test["output"]):
            return False, False, "test %d: wrong output" % index
        return True, False, ""
    # Exactly: every judged assertion once, in order, then "done".
    if len(events) != len(expected) + 1 or events[-1] != ["d"]:
        return False, False, "test %d: did not finish (no report of its end)" % index
    for k, (event, (op, compare, value, program_left)) in enumerate(zip(events, expected)):
        if not (isinstance(event, list) and len(event) == 3 and event[0] in ("r", "u") and event[1] == k):
            return False, False, "test %d: did not finish (assertion %d not reported)" % (index, k)
        if event[0] == "u":
            name = bytes.fromhex(event[2]).decode(errors="replace") if isinstance(event[2], str) else "?"
            return False, False, "test %d: assertion %d: the program's side is a %s, not plain data" % (index, k, name[:60])
        try:
            got = decode(event[2])
            ok = bool(compare(got, value) if program_left else compare(value, got))
        except Exception:
            return False, False, "test %d: assertion %d: unreadable or incomparable value" % (index, k)
        if not ok:
            return False, False, "test %d: assertion %d failed: got %s, expected %s %s" % (index, k, short(got), op, short(value))
    return True, False, ""


def run_all():
    passed, first_failure, timeouts = [], "", 0
    for index, test in enumerate(job["tests"]):
        ok, timed_out, why = run_one(index, test)
        passed.append(ok)
        timeouts += timed_out
        first_failure = first_failure or why
    report = json.dumps({"passed": passed, "isolated": isolated, "fs_private": not fs_why, "detail": first_failure, "timeouts": timeouts}).encode()
    os.write(results_fd, report)
    os.close(results_fd)


run_all()
os._exit(0)
'''


# What runs in each test's fresh interpreter (`python -I -S -c RUNNER`), before and around
# the program. Trusted code, but in the program's process: nothing here is secret, and what
# it reports on fd 4 is taken as the program's word (see the module docstring).
# fd 3: marshal of {"io", "code", "steps", "index"}; fd 4: one JSON list a line:
# ["h"] at start; ["r", k, value] / ["u", k, hex type name] per judged assertion; ["e", hex
# text] for an exception; ["d"] at the end. Values are tagged lists of hex strings (see
# `decode` in HARNESS), so no json module is needed here.
RUNNER = r"""
import marshal, os, sys


def main():
    write, exit, BaseExc, SysExit, type_, len_, hex_ = os.write, os._exit, BaseException, SystemExit, type, len, hex
    fhex = float.hex

    def emit(text):
        data = (text + "\n").encode()
        while data:
            data = data[write(4, data):]

    emit('["h"]')
    with open(3, "rb") as f:
        job = marshal.loads(f.read())
    modules = sys.modules
    sequences = {list: "l", tuple: "t", set: "S", frozenset: "F"}

    def stdlib_type(module, name):
        # Only once the program imported it (importing it here would cost every test).
        return getattr(modules.get(module), name, None)

    def encode(v, depth):
        t = type_(v)
        if depth > 100:
            raise ValueError("nested too deeply")
        if v is None:
            return '["n"]'
        if t is bool:
            return '["b","%d"]' % v
        if t is int:
            return '["i","%s"]' % hex_(v)
        if t is float:
            return '["f","%s"]' % fhex(v)
        if t is complex:
            return '["c","%s","%s"]' % (fhex(v.real), fhex(v.imag))
        if t is str:
            return '["s","%s"]' % v.encode("utf-8", "surrogatepass").hex()
        if t is bytes:
            return '["y","%s"]' % v.hex()
        if t in sequences:
            return '["%s",[%s]]' % (sequences[t], ",".join([encode(x, depth + 1) for x in v]))
        if t is dict or any(t is stdlib_type("collections", n) for n in ("Counter", "OrderedDict", "defaultdict")):
            return '["d",[%s]]' % ",".join(["[%s,%s]" % (encode(k, depth + 1), encode(x, depth + 1)) for k, x in dict.items(v)])
        if t is stdlib_type("fractions", "Fraction"):
            return '["q","%s","%s"]' % (hex_(int(v.numerator)), hex_(int(v.denominator)))
        if t is stdlib_type("decimal", "Decimal"):
            return '["D","%s"]' % str(v).encode("ascii").hex()
        raise TypeError(t.__name__)

    def failed(e):
        try:
            text = "%s: %s" % (type_(e).__name__, str(e)[:200])
        except BaseExc:
            text = type_(e).__name__
        try:
            write(2, ("test %d: %s\n" % (job["index"], text)).encode(errors="replace"))
        except BaseExc:
            pass
        emit('["e","%s"]' % text.encode("utf-8", "replace").hex())
        exit(1)

    io_test = job["io"]
    namespace = {"__name__": "__main__" if io_test else "solution", "__builtins__": __builtins__}
    where = "<test %d>" % job["index"]
    try:
        exec(compile(job["code"], "<solution>", "exec"), namespace)
        for step in job["steps"]:
            if step[0] == "x":
                exec(compile(step[1], where, "exec"), namespace)
                continue
            value = eval(compile(step[1], where, "eval"), namespace)
            try:
                text = '["r",%d,%s]' % (step[2], encode(value, 0))
            except (TypeError, ValueError, RecursionError) as e:
                text = '["u",%d,"%s"]' % (step[2], str(e)[:60].encode("utf-8", "replace").hex())
            emit(text)
        if io_test:
            sys.stdout.flush()
    except SysExit as e:
        # An io program may end itself with status 0 (its output is what is judged);
        # an assertion test must run to its end.
        if not (io_test and (e.code is None or (type_(e.code) is int and e.code == 0))):
            failed(e)
        try:
            sys.stdout.flush()
        except BaseExc as e2:
            failed(e2)
    except BaseExc as e:
        failed(e)
    emit('["d"]')
    exit(0)


main()
"""
