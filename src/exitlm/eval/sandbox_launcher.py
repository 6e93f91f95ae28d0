"""The child half of :mod:`exitlm.eval.sandbox`: ``python -I -S -B sandbox_launcher.py CONFIG``.

Run as a script (it imports nothing of exitlm, only the standard library), in a new session
started by :func:`exitlm.eval.sandbox.run_python`. ``CONFIG`` is a JSON object: ``dir`` (the
sandbox's directory, the only writable place), ``argv`` (the program), ``read`` / ``read_files``
/ ``write_files`` (what else may be opened), ``limits`` and ``isolate``.

With ``isolate`` the launcher, before the program starts:

1. moves into new user, network and PID namespaces when the kernel lets an unprivileged
   process (``unshare(CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWPID)``): no network interface
   but a down loopback, no capability outside, and every process of the program dies with it;
2. forks the program's first process, which sets resource limits (CPU time, address space,
   processes, file size, open files, no core dumps), ``no_new_privs``, a seccomp filter (no
   ``socket()``, no io_uring, no ``kill(-1)``, no foreign system-call ABI) and a Landlock
   domain (read and execute only the interpreter and system directories, write only ``dir``;
   no TCP bind/connect and no signals or abstract sockets outside the sandbox where the kernel
   has those Landlock ABIs), then executes ``argv`` with an empty environment.

Namespaces, seccomp and Landlock are inherited by every child, so a shell started by
``os.system`` or ``ctypes.CDLL(None).system`` is confined the same way. A setup failure exits
with status 125 and one ``exitlm-sandbox:`` line on stderr.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import platform
import resource
import signal
import struct
import sys

SETUP_FAILED = 125

# Landlock (linux/landlock.h); the syscall numbers are the same on every architecture
_LL_CREATE, _LL_ADD, _LL_RESTRICT = 444, 445, 446
_FS_EXECUTE, _FS_WRITE_FILE, _FS_READ_FILE, _FS_READ_DIR = 1, 2, 4, 8
_FS_TRUNCATE, _FS_IOCTL_DEV = 1 << 14, 1 << 15
_FILE_ACCESS = _FS_EXECUTE | _FS_WRITE_FILE | _FS_READ_FILE | _FS_TRUNCATE | _FS_IOCTL_DEV
_READ = _FS_EXECUTE | _FS_READ_FILE | _FS_READ_DIR

# seccomp: (audit arch, socket, kill, io_uring_setup) per machine
_ARCH = {"x86_64": (0xC000003E, 41, 62, 425), "aarch64": (0xC00000B7, 198, 129, 425)}
_CLONE_NEWUSER, _CLONE_NEWNET, _CLONE_NEWPID = 0x10000000, 0x40000000, 0x20000000

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def _fail(what: str) -> None:
    err = ctypes.get_errno()
    print(f"exitlm-sandbox: {what} failed ({os.strerror(err) if err else 'unsupported'})",
          file=sys.stderr, flush=True)
    os._exit(SETUP_FAILED)


def landlock_abi() -> int:
    """The kernel's Landlock ABI version (0: none)."""
    v = _libc.syscall(_LL_CREATE, None, ctypes.c_size_t(0), ctypes.c_uint32(1))
    return max(int(v), 0)


def _fs_access(abi: int) -> int:
    bits = (1 << 13) - 1  # ABI 1: execute ... make_sym
    if abi >= 2:
        bits |= 1 << 13  # refer
    if abi >= 3:
        bits |= _FS_TRUNCATE
    if abi >= 5:
        bits |= _FS_IOCTL_DEV
    return bits


def _landlock(work: str, read: list[str], read_files: list[str], write_files: list[str]) -> None:
    abi = landlock_abi()
    if abi < 1:
        _fail("Landlock")
    fs = _fs_access(abi)
    attr = struct.pack("<QQQ", fs, 3 if abi >= 4 else 0, 3 if abi >= 6 else 0)
    size = 8 if abi < 4 else 16 if abi < 6 else 24  # no TCP; no signals / abstract sockets out
    buf = ctypes.create_string_buffer(attr[:size])
    ruleset = _libc.syscall(_LL_CREATE, buf, ctypes.c_size_t(size), ctypes.c_uint32(0))
    if ruleset < 0:
        _fail("landlock_create_ruleset")
    rules = [(p, _READ, False) for p in read] + [(p, _FS_READ_FILE, True) for p in read_files]
    rules += [(p, _FS_READ_FILE | _FS_WRITE_FILE, True) for p in write_files]
    rules.append((work, fs, False))
    for path, access, is_file in rules:
        try:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except OSError:
            continue  # a path this system lacks
        allowed = access & fs & (_FILE_ACCESS if is_file else ~0)
        rule = ctypes.create_string_buffer(struct.pack("<Qi", allowed, fd))  # packed: 12 bytes
        if _libc.syscall(_LL_ADD, ctypes.c_int(ruleset), ctypes.c_int(1), rule,
                         ctypes.c_uint32(0)) < 0:
            _fail(f"landlock_add_rule({path})")
        os.close(fd)
    if _libc.syscall(_LL_RESTRICT, ctypes.c_int(ruleset), ctypes.c_uint32(0)) < 0:
        _fail("landlock_restrict_self")
    os.close(ruleset)


def _seccomp() -> None:
    arch = _ARCH.get(platform.machine())
    if arch is None:
        _fail(f"seccomp on {platform.machine()}")
    audit, nr_socket, nr_kill, nr_uring = arch
    allow, kill = 0x7FFF0000, 0x80000000
    deny = 0x00050000 | 1  # SECCOMP_RET_ERRNO | EPERM

    def ld(off: int) -> tuple:
        return (0x20, 0, 0, off)  # BPF_LD | BPF_W | BPF_ABS

    def jeq(k: int, jt: int, jf: int) -> tuple:
        return (0x15, jt, jf, k)

    def ret(k: int) -> tuple:
        return (0x06, 0, 0, k)

    prog = [ld(4), jeq(audit, 1, 0), ret(kill),                       # 0-2: our ABI only
            ld(0), (0x35, 4, 0, 0x40000000),                          # 3-4: no x32 calls
            jeq(nr_socket, 3, 0), jeq(nr_uring, 2, 0), jeq(nr_kill, 2, 0),  # 5-7
            ret(allow), ret(deny),                                    # 8-9
            ld(16), jeq(0xFFFFFFFF, 0, 1), ret(deny), ret(allow)]     # 10-13: kill(-1, ...)
    code = b"".join(struct.pack("<HBBI", *ins) for ins in prog)
    filt = ctypes.create_string_buffer(code)
    fprog = struct.pack("<HxxxxxxQ", len(prog), ctypes.addressof(filt))
    fbuf = ctypes.create_string_buffer(fprog)
    if _libc.prctl(22, 2, fbuf, 0, 0) != 0:  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER
        _fail("seccomp")


def _own_processes() -> int:
    uid, n = os.getuid(), 0
    for name in os.listdir("/proc"):
        with contextlib.suppress(OSError):
            n += name.isdigit() and os.stat(f"/proc/{name}").st_uid == uid
    return n


def _rlimits(limits: dict, processes_base: int) -> None:
    cpu = max(1, int(limits["cpu_s"] + 0.999))
    for what, value in ((resource.RLIMIT_CPU, cpu),
                        (resource.RLIMIT_AS, limits["memory_mb"] * 2**20),
                        (resource.RLIMIT_NPROC, processes_base + limits["processes"]),
                        (resource.RLIMIT_FSIZE, limits["file_mb"] * 2**20),
                        (resource.RLIMIT_NOFILE, limits["open_files"]),
                        (resource.RLIMIT_CORE, 0)):
        _, hard = resource.getrlimit(what)
        value = value if hard == resource.RLIM_INFINITY else min(value, hard)
        resource.setrlimit(what, (value, value))


def main(config: dict) -> int:
    """Set up, start the program, wait for it; its exit status (128 + signal when killed)."""
    isolate = bool(config["isolate"])
    in_namespaces = False
    if isolate:
        flags = _CLONE_NEWUSER | _CLONE_NEWNET | _CLONE_NEWPID
        in_namespaces = _libc.unshare(ctypes.c_int(flags)) == 0
        if not in_namespaces and config.get("require_namespaces"):
            _fail("unshare")
    base = 0 if in_namespaces else _own_processes()  # NPROC counts per user (namespace)
    pid = os.fork()
    if pid == 0:
        try:
            _libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG: die with the launcher
            os.chdir(config["dir"])
            _rlimits(config["limits"], base)
            if isolate:
                if _libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
                    _fail("no_new_privs")
                _seccomp()
                _landlock(config["dir"], config["read"], config["read_files"],
                          config["write_files"])
            os.execve(config["argv"][0], config["argv"], {})
        except BaseException as err:  # reported as the setup failure it is
            print(f"exitlm-sandbox: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
        os._exit(SETUP_FAILED)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else (
        128 + os.WTERMSIG(status))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--landlock-abi"]:
        print(landlock_abi())
        sys.exit(0)
    sys.exit(main(json.loads(sys.argv[1])))
