"""docker/seccomp/reward.json: Docker's default seccomp profile plus what the code sandbox needs.

No Docker daemon runs here. The profile is checked as data (schema, the additions, nothing
else widened), and then applied the way runc would apply it to a container without
capabilities (through libseccomp, loaded with ctypes; skipped where it is missing) to a
process that runs the sandbox as `nobody`: under Docker's default profile the sandbox
cannot start, under reward.json it runs isolated. AppArmor, Docker's masked /proc paths and
the container's own mounts are not reproduced: under real Docker `private_fs` may be False.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import platform
import re
import stat
import subprocess
from pathlib import Path
from typing import Any

import pytest

from rollstream.reward import sandbox

REPO = Path(__file__).resolve().parents[2]
PROFILE = REPO / "docker" / "seccomp" / "reward.json"
# What the harness calls that Docker's default profile allows only with CAP_SYS_ADMIN.
ADDED = {"chroot", "mount", "mount_setattr", "unshare"}
# The rest of what the sandbox needs; Docker's default allows these to every container.
ALSO_NEEDED = {
    "capset", "prctl", "execve", "setpgid", "memfd_create", "pidfd_open", "setrlimit", "prlimit64",
    "fcntl", "dup2", "dup3", "close", "wait4", "waitid", "kill", "pselect6", "pread64", "lseek", "chdir", "setgroups",
    "setgid", "setuid", "getrandom",
}  # fmt: skip
# Never to be allowed without the capability that Docker's default asks for.
STILL_PRIVILEGED = {
    "setns",
    "pivot_root",
    "umount2",
    "bpf",
    "ptrace",
    "process_vm_readv",
    "kexec_load",
    "open_by_handle_at",
    "init_module",
    "clone3",
}


def _profile() -> dict[str, Any]:
    return json.loads(PROFILE.read_text())


def _unconditional(profile: dict[str, Any]) -> set[str]:
    """Names allowed to any container on x86-64: no caps, arch or kernel condition, no args."""
    names: set[str] = set()
    for rule in profile["syscalls"]:
        if (
            rule["action"] == "SCMP_ACT_ALLOW"
            and not rule.get("args")
            and not rule.get("includes")
            and not rule.get("excludes")
        ):
            names.update(rule["names"])
    return names


def test_profile_has_dockers_schema() -> None:
    profile = _profile()
    assert profile["defaultAction"] == "SCMP_ACT_ERRNO"
    assert profile["defaultErrnoRet"] == 1
    arches = {a["architecture"] for a in profile["archMap"]}
    assert {"SCMP_ARCH_X86_64", "SCMP_ARCH_AARCH64"} <= arches
    for rule in profile["syscalls"]:
        assert set(rule) <= {"names", "action", "args", "includes", "excludes", "errnoRet", "comment"}, rule
        assert rule["names"] and all(isinstance(n, str) for n in rule["names"])
        assert rule["action"] in {"SCMP_ACT_ALLOW", "SCMP_ACT_ERRNO"}
        for arg in rule.get("args") or []:
            assert set(arg) <= {"index", "value", "valueTwo", "op"} and arg["op"].startswith("SCMP_CMP_")


def test_profile_allows_what_the_sandbox_needs_and_no_more() -> None:
    profile = _profile()
    allowed = _unconditional(profile)
    assert ADDED | ALSO_NEEDED <= allowed, sorted((ADDED | ALSO_NEEDED) - allowed)
    assert not STILL_PRIVILEGED & allowed, sorted(STILL_PRIVILEGED & allowed)
    # The additions are one rule, apart from Docker's own (which keeps them for CAP_SYS_ADMIN).
    added = [r for r in profile["syscalls"] if ADDED & set(r["names"]) and not r.get("includes")]
    assert len(added) == 1 and set(added[0]["names"]) == ADDED and "comment" in added[0]
    # Docker's rule for clone without CAP_SYS_ADMIN (no namespace flags) is unchanged: the
    # harness creates namespaces with unshare(2), then forks.
    clone_rules = [r for r in profile["syscalls"] if r["names"] == ["clone"] and not r.get("includes")]
    assert clone_rules and clone_rules[0]["args"] == [{"index": 0, "value": 2114060288, "op": "SCMP_CMP_MASKED_EQ"}]


def test_the_added_syscalls_are_the_ones_the_harness_makes() -> None:
    # libc.<name>(...) calls and the raw mount_setattr number in the harness: if the harness
    # starts calling something else of that kind, this list (and the profile) must follow.
    harness = sandbox.HARNESS_PATH.read_text()
    calls = set(re.findall(r"libc\.(\w+)\(", harness))
    assert calls == {"unshare", "mount", "prctl", "capset", "syscall"}, calls
    assert "SYS_MOUNT_SETATTR = 442" in harness
    assert {"unshare", "mount"} <= ADDED and "mount_setattr" in ADDED
    assert "os.chroot(root)" in harness and "chroot" in ADDED  # into the minimal root


# --- applying the profile -------------------------------------------------------------------

# Loads a profile (argv[2], JSON) into libseccomp as runc would for a container with no
# capabilities on this machine's architecture, applies it to itself, then runs the sandbox
# module (argv[1]) on a small job and prints the result (or the SandboxUnavailable) as JSON.
APPLY = r"""
import ctypes, ctypes.util, importlib.util, json, os, platform, sys

profile = json.loads(sys.argv[2])
ARCH = {"x86_64": "amd64", "aarch64": "arm64"}[platform.machine()]
kernel = tuple(int(x) for x in platform.release().split("-")[0].split(".")[:2])
lib = ctypes.CDLL(ctypes.util.find_library("seccomp"), use_errno=True)
lib.seccomp_init.restype = ctypes.c_void_p
lib.seccomp_init.argtypes = [ctypes.c_uint32]
lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint, ctypes.c_void_p]
lib.seccomp_load.argtypes = [ctypes.c_void_p]
lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]


class Cmp(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("a", ctypes.c_uint64), ("b", ctypes.c_uint64)]


OPS = {"SCMP_CMP_NE": 1, "SCMP_CMP_LT": 2, "SCMP_CMP_LE": 3, "SCMP_CMP_EQ": 4, "SCMP_CMP_GE": 5, "SCMP_CMP_GT": 6, "SCMP_CMP_MASKED_EQ": 7}


def action(name, errno):
    return 0x7FFF0000 if name == "SCMP_ACT_ALLOW" else 0x00050000 | (errno & 0xFFFF)


ctx = lib.seccomp_init(action(profile["defaultAction"], profile.get("defaultErrnoRet", 1)))
for rule in profile["syscalls"]:
    inc, exc = rule.get("includes") or {}, rule.get("excludes") or {}
    # As runc: no capabilities in the bounding set, this machine's arch, this kernel.
    if ARCH in (exc.get("arches") or []) or inc.get("caps"):
        continue
    if inc.get("arches") and ARCH not in inc["arches"]:
        continue
    if inc.get("minKernel") and kernel < tuple(int(x) for x in inc["minKernel"].split(".")):
        continue
    args = rule.get("args") or []
    # MASKED_EQ: value is the mask, valueTwo the datum (as runc hands them to libseccomp).
    conds = (Cmp * max(1, len(args)))(*[Cmp(a["index"], OPS[a["op"]], a["value"], a.get("valueTwo", 0)) for a in args])
    for name in rule["names"]:
        nr = lib.seccomp_syscall_resolve_name(name.encode())
        if nr < 0:
            continue  # not a system call of this architecture
        rc = lib.seccomp_rule_add_array(ctx, action(rule["action"], rule.get("errnoRet", 1)), nr, len(args), conds)
        if rc != 0:
            sys.exit("seccomp_rule_add %s: %d" % (name, rc))
libc = ctypes.CDLL(None, use_errno=True)
if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS, as no-new-privileges
    sys.exit("no_new_privs")
if lib.seccomp_load(ctx) != 0:
    sys.exit("seccomp_load")

spec = importlib.util.spec_from_file_location("sandbox_under_test", sys.argv[1])
sandbox = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = sandbox
spec.loader.exec_module(sandbox)
code = "def add(a, b):\n    return a + b\nif __name__ == '__main__':\n    print(add(*map(int, input().split())))\n"
tests = ["assert add(1, 2) == 3", "x = add(2, 2)\nassert x == 4", {"input": "20 22\n", "output": "42"}, "assert add(1, 1) == 3"]
try:
    r = sandbox.run_tests(code, tests, sandbox.SandboxLimits(wall_s=20.0))
    print(json.dumps({"passed": r.passed, "isolated": r.isolated, "private_fs": r.private_fs}))
except sandbox.SandboxUnavailable as e:
    print(json.dumps({"unavailable": str(e)}))
"""


def _readable_by_others(path: Path) -> bool:
    return bool(path.stat().st_mode & stat.S_IROTH) and all(p.stat().st_mode & stat.S_IXOTH for p in path.parents)


def _apply(profile: dict[str, Any]) -> dict[str, Any]:
    done = subprocess.run(
        ["/usr/bin/python3", "-I", "-c", APPLY, str(Path(sandbox.__file__).resolve()), json.dumps(profile)],
        check=False,
        user=65534, group=65534, extra_groups=[], cwd="/", env={"PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.skipif(
    os.geteuid() != 0
    or ctypes.util.find_library("seccomp") is None
    or platform.machine() not in ("x86_64", "aarch64")
    or not Path("/usr/bin/python3").exists()
    or not _readable_by_others(Path(sandbox.__file__).resolve()),
    reason="needs root (to start a process as nobody), libseccomp, /usr/bin/python3 and the sandbox module readable by others",
)
def test_under_the_profile_the_sandbox_runs_and_under_dockers_default_it_cannot() -> None:
    profile = _profile()
    default = dict(
        profile, syscalls=[r for r in profile["syscalls"] if not (ADDED & set(r["names"]) and not r.get("includes"))]
    )
    refused = _apply(default)
    assert "unshare failed with errno 1" in refused.get("unavailable", ""), refused
    report = _apply(profile)
    assert report == {"passed": [True, True, True, False], "isolated": True, "private_fs": True}, report
