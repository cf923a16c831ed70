"""The code sandbox's harness: trusted code that fences itself in, then runs each test in
a fresh interpreter running the runner (started by `spawn` with nothing but the fds it
needs) and judges it from the outside; it never runs the program itself. sandbox.py's
docstring holds the design, what is guaranteed and the isolation.

`rollstream.reward.sandbox.run_tests` runs this file by its path, `python -I -S
sandbox_harness.py JOB`: no environment and no site-packages, so the standard library
only. JOB is a JSON file, read and deleted at once (it holds the expected outputs): the
program and its tests, the limits, the fd to report on, the user to drop to, the folder
for the minimal root, and the text of sandbox_runner.py, which each test's interpreter
runs with -c (that folder is not inside the fence, and text in the harness's memory is
out of the program's reach, where a file might be replaced between tests).

What it expects of each test and how it judges the report: sandbox_judge.py beside it.
Importing it runs nothing: the run is the block under `if __name__ == "__main__"`, at the end.
"""

import ctypes
import fcntl
import json
import marshal
import os
import resource
import select
import signal
import sys
import time

libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWNET, CLONE_NEWPID, CLONE_NEWUSER = (
    0x00020000,
    0x08000000,
    0x40000000,
    0x20000000,
    0x10000000,
)
PR_SET_PDEATHSIG, PR_SET_DUMPABLE = 1, 4
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_BIND, MS_REC, MS_PRIVATE = 0x1, 0x2, 0x4, 0x8, 0x1000, 0x4000, 0x40000
MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID = 0x1, 0x2
AT_FDCWD, AT_RECURSIVE = -100, 0x8000
SYS_MOUNT_SETATTR = 442  # Linux 5.12; new system calls have one number on x86-64 and arm64 alike
LINUX_CAPABILITY_VERSION_3 = 0x20080522


class MountAttr(ctypes.Structure):
    _fields_ = [
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    ]


def fail(status, text):
    """Ends the harness with `status`, saying why on stderr (the service reports its tail)."""
    sys.stderr.write(text + "\n")
    sys.stderr.flush()
    os._exit(status)


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
            for name, text in (
                ("setgroups", "deny"),
                ("uid_map", "%d %d 1" % (uid, uid)),
                ("gid_map", "%d %d 1" % (gid, gid)),
            ):
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
ALLOWED_ETC = (
    "ld.so.cache",
    "ld.so.conf",
    "ld.so.conf.d",
    "alternatives",
    "localtime",
    "os-release",
    "passwd",
    "group",
    "nsswitch.conf",
)
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
    needed = {
        os.path.realpath(p)
        for p in (sys.base_prefix, sys.base_exec_prefix, os.path.dirname(os.path.realpath(sys.executable)))
    }
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
    for folder in ("/tmp", "/var/tmp", "/dev/shm", "/proc"):
        os.makedirs(root + folder, exist_ok=True)
    for name, target in (
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
    ):
        os.symlink(target, root + "/dev/" + name)
    # The service's own folders (its work dir, its home) hidden where an allowed tree holds
    # them (a checkout under /usr/src), unless the interpreter lives there.
    for folder in job["hide"]:
        if (
            folder != "/"
            and os.path.isdir(root + folder)
            and not any(t == folder or t.startswith(folder + "/") for t in trees)
        ):
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
    if (
        libc.syscall(
            SYS_MOUNT_SETATTR,
            AT_FDCWD,
            root.encode(),
            AT_RECURSIVE,
            ctypes.byref(attr),
            ctypes.c_size_t(ctypes.sizeof(attr)),
        )
        != 0
    ):
        why = "mount_setattr (read-only tree): %s" % os.strerror(ctypes.get_errno())
    top = root.rstrip("/")
    try:
        mount_tmpfs(top + "/tmp")
    except OSError as e:
        if not why:
            fail(1, "private file system: %s after the tree became read-only; no writable work dir" % e)
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
            view = view[os.write(fd, view) :]
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
        os.closerange(len(fds), max(job["open_files"], results_fd + 1, 256))
        signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
        os.execv(PYTHON, [PYTHON, "-I", "-S", "-c", job["runner"]])
    except BaseException as e:  # noqa: BLE001 - a forked child never returns into the harness: it reports and exits
        try:
            os.write(2, ("cannot start %s: %s\n" % (PYTHON, e)).encode(errors="replace"))
        except BaseException:  # noqa: BLE001 - stderr gone too: the exit status alone says it
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
    steps, expected = ([], []) if io_test else plan(test)
    limit = job["file_bytes"]
    fds, report_r = [], -1
    try:
        try:
            fds.append(scratch(test.get("input", "").encode() if io_test else b""))
        except OSError as e:
            return False, False, "test %d: its input cannot be given to the program: %s" % (index, e)
        # Reports go through a pipe: what RUNNER wrote there, the program cannot take back.
        report_r, report_w = os.pipe()
        fds += [
            scratch(),
            2,
            scratch(marshal.dumps({"io": io_test, "code": job["code"], "steps": steps, "index": index})),
            report_w,
        ]
        pid = spawn(fds)
        for position in (0, 3, 4):
            os.close(fds[position])  # the program's own now
            fds[position] = -1
        ended, chunks = watch(pid, report_r, job["test_timeout_s"], limit)
        try:
            (os.killpg if isolated else os.kill)(pid, signal.SIGKILL)
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
        fail(
            122,
            "test %d: %s did not start inside the sandbox (exit status %d)"
            % (index, PYTHON, os.waitstatus_to_exitcode(status)),
        )
    if len(report) > limit:
        return False, False, "test %d: reported more than the file-size limit" % index
    if not ended or cpu_killed:
        why = (
            "timed out after %ss" % job["test_timeout_s"]
            if not ended
            else "ran past the CPU limit (%ss)" % job["cpu_s"]
        )
        return False, True, "test %d: %s" % (index, why)
    return verdict(index, test, lines[1:], expected, output, os.waitstatus_to_exitcode(status), limit)


def run_all():
    passed, first_failure, timeouts = [], "", 0
    for index, test in enumerate(job["tests"]):
        ok, timed_out, why = run_one(index, test)
        passed.append(ok)
        timeouts += timed_out
        first_failure = first_failure or why
    report = json.dumps(
        {
            "passed": passed,
            "isolated": isolated,
            "fs_private": not fs_why,
            "detail": first_failure,
            "timeouts": timeouts,
        }
    ).encode()
    os.write(results_fd, report)
    os.close(results_fd)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # -I leaves out this file's folder, the judge's
    from sandbox_judge import plan, verdict

    with open(sys.argv[1]) as f:
        job = json.load(f)
    os.unlink(sys.argv[1])  # it holds the expected outputs: the program must not read them
    results_fd = job["results_fd"]
    os.set_inheritable(results_fd, False)  # never passed on to a test's interpreter (see spawn)
    # Each private temp dir holds one test's input and output at the file-size limit; the
    # inode cap keeps a program from filling kernel memory with empty files.
    TMPFS_OPTIONS = "size=%d,nr_inodes=4096,mode=1777" % (2 * job["file_bytes"])
    in_user_ns = os.geteuid() != 0
    uid, gid = os.geteuid(), os.getegid()
    # IPC too: System V objects and POSIX message queues would otherwise be the host's and outlive the run.
    flags = CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | (CLONE_NEWUSER if in_user_ns else 0)
    isolated = libc.unshare(flags | CLONE_NEWNS) == 0
    has_mount_ns = isolated
    if not isolated:
        isolated = libc.unshare(flags) == 0  # no mount namespace here: keep the rest of the isolation
    if not isolated and job["require_isolation"]:
        fail(
            121,
            "network isolation unavailable: unshare failed with errno %d (%s)"
            % (ctypes.get_errno(), os.strerror(ctypes.get_errno())),
        )
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
        fail(1, "prctl(PR_SET_DUMPABLE): %s" % os.strerror(ctypes.get_errno()))
    if fs_why:
        sys.stderr.write("private file system not in place: %s\n" % fs_why)
        sys.stderr.flush()
    resource.setrlimit(resource.RLIMIT_CPU, (job["cpu_s"], job["cpu_s"] + 1))
    resource.setrlimit(resource.RLIMIT_AS, (job["memory_bytes"], job["memory_bytes"]))
    resource.setrlimit(resource.RLIMIT_NPROC, (job["max_processes"], job["max_processes"]))
    resource.setrlimit(resource.RLIMIT_FSIZE, (job["file_bytes"], job["file_bytes"]))
    resource.setrlimit(resource.RLIMIT_NOFILE, (job["open_files"], job["open_files"]))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    # A file larger than the file-size limit (a huge test input) fails the write, rather than
    # kill the harness; the tests' processes get the default back before they exec.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    # By its real path: a venv's link is outside the minimal root (-I -S: no site-packages anyway).
    PYTHON = os.path.realpath(sys.executable)
    run_all()
    os._exit(0)
