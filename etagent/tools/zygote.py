"""Fork server that runs model-written Python in isolated, throw-away processes.

Started by ``etagent.tools.sandbox.PythonSandbox`` as ``python zygote.py --dir DIR ...``; not
meant to be run by hand. It uses only the standard library so that any interpreter a user points
the sandbox at (Python >= 3.8) can run it.

Start-up (once): import the preload modules (so calls start warm), enter a private mount
namespace whose root is a fresh tmpfs holding read-only bind mounts of only what Python needs
(the interpreter's prefixes and site-packages, /usr, /lib*, /bin, a few files of /etc, and
/dev/{null,zero,full,random,urandom}), then answer connections on a Unix socket.

Per call: fork a handler; the handler drops to an unprivileged identity and creates new user,
mount, network, PID, IPC and UTS namespaces; it forks the runner, which is PID 1 of the new PID
namespace: when the runner exits or is killed, the kernel kills every process it left behind.
The runner mounts a private /proc and a size-limited tmpfs on /tmp (its working directory),
starts a new session, applies resource limits, scrubs the environment, drops every capability,
sets no_new_privs, and executes the code (a bare last expression is printed, as in a REPL). The
handler collects stdout and stderr (capped), enforces the wall-clock timeout by killing the
runner, and answers with one JSON message.

Where namespaces cannot be created (some containers forbid unshare), ``--isolation rlimits``
runs the same steps without them: see the host module's docstring for what is lost.

Lifetime: everything a call starts dies with the host (the process that started this server),
however the host dies, ``kill -9`` included, and nothing is left on disk:

- the server follows the host through its stdin: EOF means the host has exited or closed the
  sandbox (the host closes that pipe in the processes it forks, which would otherwise keep it
  open). It does not use a parent-death signal towards the host, since the kernel sends that
  when the *thread* that forked it exits, and the host may start it from a short-lived thread
  (``asyncio.to_thread``). It runs in its own session so that a signal to the host's process
  group (Ctrl-C, ``kill -9 -PGID``) does not take it down before it has cleaned up;
- on that EOF or SIGTERM it sends SIGTERM to its handlers (its process group), waits for them,
  removes ``DIR`` (the socket, the minimal root's mount point and, with ``rlimits``, the calls'
  working directories) and exits. A killed host cannot remove anything, which is why the server,
  which outlives it by a few milliseconds, owns that directory;
- a handler gets SIGTERM as its parent-death signal too (the server killed by SIGKILL): it kills
  its runner (PID 1 of the call's PID namespace, so the kernel kills every process of the call;
  with ``rlimits`` the runner's process group), removes its working directory and exits;
- a runner gets SIGKILL as its parent-death signal, for a handler killed by SIGKILL.

Each parent-death signal is set right after fork (again after a change of credentials, which
clears it) and followed by a check that the parent is still there, for a parent that died before.
Not covered: with ``rlimits``, processes that left the runner's process group (``setsid``,
``setpgid``) outlive the call, and when a handler itself is killed by SIGKILL (by someone else:
the server sends SIGTERM), the runner dies but the rest of its process group is left; code that
clears its own parent-death signal outlives a handler killed by SIGKILL. If the server is killed
by SIGKILL together with the host (a whole cgroup killed, say), the processes die but ``DIR`` is
left, for the next sandbox started on the machine to remove
(``sandbox._remove_abandoned_directories``).
"""

import ast
import contextlib
import ctypes
import gc
import json
import os
import resource
import select
import selectors
import shutil
import signal
import socket
import struct
import sys
import tempfile
import time
import traceback

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 1, 4, 24, 38
NOBODY = 65534

_libc = ctypes.CDLL(None, use_errno=True)
# True when start-up had to create a user namespace (an unprivileged host user): the zygote is
# then uid 0 of that namespace, which is the host user, not root.
_IN_OWN_USERNS = False


def _check(result, what):
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(source, target, fstype, flags, data=None):
    enc = lambda s: s.encode() if s is not None else None  # noqa: E731
    _check(_libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)), f"mount {target}")


def _unshare(flags):
    _check(_libc.unshare(flags), "unshare")


def _write(path, text):
    with open(path, "w") as f:
        f.write(text)


def _die_with_parent(sig, parent_alive):
    """Have the kernel send sig to this process when its parent dies.

    The kernel sends it when the parent's *thread* that forked us exits (the server and the
    handlers are single-threaded, so that is their death), and clears it when our credentials
    change: call it right after fork and again after any setuid or new user namespace. A parent
    that died before the prctl is caught by parent_alive().
    """
    _check(_libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0), "PR_SET_PDEATHSIG")
    if not parent_alive():
        os._exit(1)


def _pipe_reader_alive(fd):
    """Whether some process still holds the read end of the pipe whose write end is fd."""
    poller = select.poll()
    poller.register(fd, 0)  # no events asked: only POLLERR (no reader left) is reported
    return not poller.poll(0)


def _map_identity(outside_uid, outside_gid):
    """Inside the new user namespace, uid/gid 0 is outside_uid/outside_gid."""
    _write("/proc/self/setgroups", "deny")
    _write("/proc/self/uid_map", f"0 {outside_uid} 1")
    _write("/proc/self/gid_map", f"0 {outside_gid} 1")


# ---------------------------------------------------------------------------------------------
# Start-up: a minimal read-only root


def _python_paths():
    """Directories the interpreter needs: prefixes and the stdlib/site-packages on sys.path."""
    prefixes = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix)}
    prefixes.add(os.path.dirname(os.path.dirname(os.path.realpath(sys.executable))))
    paths = set(prefixes)
    for entry in sys.path:
        real = os.path.realpath(entry) if entry else ""
        # only library directories under a prefix or named site-packages/dist-packages; never
        # the working directory or a project tree on sys.path (editable installs put one there)
        if os.path.isdir(real) and (
            any(real.startswith(p + os.sep) for p in prefixes) or real.endswith(("site-packages", "dist-packages"))
        ):
            paths.add(real)
    # drop paths inside another one
    kept = []
    for p in sorted(paths, key=len):
        if not any(p == k or p.startswith(k.rstrip(os.sep) + os.sep) for k in kept):
            kept.append(p)
    return kept


_SYSTEM_DIRS = ["/usr", "/bin", "/sbin", "/lib", "/lib64", "/lib32", "/libx32", "/etc/alternatives", "/etc/ld.so.conf.d", "/etc/ssl"]
_SYSTEM_FILES = ["/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/localtime", "/etc/passwd", "/etc/group", "/etc/nsswitch.conf", "/etc/hosts"]
_DEVICES = ["/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom"]


def _bind_readonly(source, target, is_dir):
    if is_dir:
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        open(target, "a").close()
    _mount(source, target, None, MS_BIND | MS_REC)
    # the remount makes the bind itself read-only and nosuid (submounts of /usr etc. are rare)
    _mount(None, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID)


def enter_minimal_root(root_dir):
    """Make root_dir (an empty directory) the root of a new private mount namespace."""
    global _IN_OWN_USERNS
    if os.getuid() == 0:
        _unshare(CLONE_NEWNS)
    else:  # an unprivileged user needs a user namespace to own the mount namespace
        uid, gid = os.getuid(), os.getgid()
        _unshare(CLONE_NEWUSER | CLONE_NEWNS)
        _map_identity(uid, gid)
        _IN_OWN_USERNS = True
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    _mount("tmpfs", root_dir, "tmpfs", MS_NOSUID | MS_NODEV, "size=16m,mode=0755")
    for path in _SYSTEM_DIRS + _python_paths():
        if os.path.islink(path) and os.path.dirname(path) == "/":  # /bin -> usr/bin on merged-/usr systems
            os.symlink(os.readlink(path), root_dir + path)
        elif os.path.isdir(path):
            _bind_readonly(path, root_dir + path, True)
    for path in _SYSTEM_FILES + _DEVICES:
        if os.path.exists(path):
            if path.startswith("/dev/"):
                os.makedirs(root_dir + "/dev", exist_ok=True)
                open(root_dir + path, "a").close()
                _mount(path, root_dir + path, None, MS_BIND)
            else:
                _bind_readonly(path, root_dir + path, False)
    for d in ("/proc", "/tmp", "/dev/shm", "/.old"):
        os.makedirs(root_dir + d, exist_ok=True)
    # the host's /proc, for the handlers (they write their namespace maps there); every call
    # mounts its own /proc over it
    _mount("/proc", root_dir + "/proc", None, MS_BIND | MS_REC)
    os.chmod(root_dir + "/tmp", 0o1777)
    _mount(None, root_dir, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, "size=16m,mode=0755")
    old = root_dir + "/.old"
    _check(_libc.syscall(155 if os.uname().machine == "x86_64" else 41, root_dir.encode(), old.encode()), "pivot_root")
    os.chdir("/")
    _check(_libc.umount2(b"/.old", MNT_DETACH), "umount old root")
    # a writable /tmp for the rlimits fallback; with namespaces each call mounts its own
    _mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, "size=512m,mode=1777")


def enter_call_namespaces():
    """Become an unprivileged identity in new user, mount, net, PID, IPC and UTS namespaces.

    Real root first drops to nobody, so the sandbox is nobody outside its namespace; an
    unprivileged host user stays itself. The next forked child is PID 1 of the new PID namespace.
    """
    if os.getuid() == 0 and not _IN_OWN_USERNS:
        os.setgroups([])
        os.setresgid(NOBODY, NOBODY, NOBODY)
        os.setresuid(NOBODY, NOBODY, NOBODY)
        _libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)  # dropping uid made /proc/self root-owned
    uid, gid = os.getuid(), os.getgid()
    _unshare(CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS)
    _map_identity(uid, gid)


def _namespaces_work():
    """Try enter_call_namespaces in a throw-away child."""
    pid = os.fork()
    if pid == 0:
        try:
            enter_call_namespaces()
            os._exit(0)
        except BaseException:
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    return os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0


# ---------------------------------------------------------------------------------------------
# Per call: the runner (PID 1 of its own namespaces)


def _drop_capabilities():
    for cap in range(64):
        _libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)  # fails harmlessly past the last capability

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]

    header, data = Header(0x20080522, 0), (Data * 2)()
    _check(_libc.capset(ctypes.byref(header), ctypes.byref(data)), "capset")
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")


def _set_limits(limits):
    mb = 1024 * 1024
    for name, value in (
        ("RLIMIT_AS", limits["memory_mb"] * mb),
        ("RLIMIT_CPU", limits["cpu_seconds"]),
        ("RLIMIT_FSIZE", limits["file_size_mb"] * mb),
        ("RLIMIT_NOFILE", limits["open_files"]),
        ("RLIMIT_NPROC", limits["processes"]),
        ("RLIMIT_CORE", 0),
    ):
        resource.setrlimit(getattr(resource, name), (value, value))


def print_last_expression(code):
    """REPL behaviour: a bare last expression that is not already a print() call is printed."""
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return code  # compile() reports the error with the user's line numbers
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        value = tree.body[-1].value
        if not (isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "print"):
            tree.body[-1] = ast.Expr(ast.Call(ast.Name("print", ast.Load()), [value], []))
            tree = ast.fix_missing_locations(tree)
            return ast.unparse(tree)
    return code


def _run_code(code):
    """Execute code as `python -c` would, printing a traceback of the user's frames only."""
    sys.argv = ["-c"]
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    try:
        exec(compile(print_last_expression(code), "<string>", "exec"), namespace)
    except SystemExit as exc:  # sys.exit(n) / sys.exit("message"), as the interpreter handles it
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)
        return 1
    except BaseException as exc:  # the user's error, reported like the interpreter would
        tb = exc.__traceback__.tb_next if exc.__traceback__ is not None else None  # skip this frame
        sys.stderr.write("".join(traceback.format_exception(type(exc), exc, tb)))
        return 1
    return 0


def runner(code, limits, isolated, stdout_fd, stderr_fd):
    """Child side of a call. Never returns."""
    status = 70
    try:
        # Killed with the handler. Whether the handler is still there is read from the stdout
        # pipe, whose read end only it holds: in its own PID namespace, getppid() reads 0.
        _die_with_parent(signal.SIGKILL, lambda: _pipe_reader_alive(stdout_fd))
        os.setsid()
        if isolated:
            _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
            _mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"size={limits['tmpfs_mb']}m,mode=1777")
            _mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, f"size={limits['tmpfs_mb']}m,mode=1777")
            os.chdir("/tmp")
        try:
            _write("/proc/self/oom_score_adj", "1000")  # if memory runs out, the kernel kills us first
        except OSError:
            pass
        null = os.open("/dev/null", os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(stdout_fd, 1)
        os.dup2(stderr_fd, 2)
        for fd in (null, stdout_fd, stderr_fd):
            os.close(fd)
        os.environ.clear()
        os.environ.update(limits["environment"])
        _set_limits(limits)
        if isolated:
            _drop_capabilities()
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
        status = _run_code(code)
    except BaseException:  # a sandbox set-up failure: report it on stderr
        traceback.print_exc()
        status = 71
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(status if isinstance(status, int) else 1)


# ---------------------------------------------------------------------------------------------
# Per call: the handler


def _recv(conn):
    header = b""
    while len(header) < 4:
        chunk = conn.recv(4 - len(header))
        if not chunk:
            raise EOFError
        header += chunk
    (size,) = struct.unpack(">I", header)
    data = b""
    while len(data) < size:
        chunk = conn.recv(min(1 << 20, size - len(data)))
        if not chunk:
            raise EOFError
        data += chunk
    return json.loads(data.decode())


def _send(conn, message):
    data = json.dumps(message).encode()
    conn.sendall(struct.pack(">I", len(data)) + data)


# The call this handler process runs, for _end_call.
_call = {"runner": None, "isolated": True, "workdir": None}


def _end_call(*_):
    """SIGTERM in a handler: the server is shutting down or was killed (the parent-death signal).
    Nobody is left to answer: stop the call, remove its working directory, exit."""
    if _call["runner"] is not None:
        _kill_runner(_call["runner"], _call["isolated"])
    if _call["workdir"] is not None:
        shutil.rmtree(_call["workdir"], ignore_errors=True)
    os._exit(1)


def handle(conn, isolation, work_parent, server_alive):
    start = time.monotonic()
    request = _recv(conn)
    limits = request["limits"]
    isolated = isolation == "namespaces"
    _call["isolated"] = isolated
    workdir = None
    if isolated:
        enter_call_namespaces()
        _die_with_parent(signal.SIGTERM, server_alive)  # again: the new credentials cleared it
    else:
        workdir = _call["workdir"] = tempfile.mkdtemp(prefix="etagent-sandbox-", dir=work_parent)
        if os.getuid() == 0 and not _IN_OWN_USERNS:
            os.chown(workdir, NOBODY, NOBODY)
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        conn.close()
        os.close(out_r)
        os.close(err_r)
        if not isolated:
            os.chdir(workdir)
            if os.getuid() == 0 and not _IN_OWN_USERNS:
                os.setgroups([])
                os.setresgid(NOBODY, NOBODY, NOBODY)
                os.setresuid(NOBODY, NOBODY, NOBODY)
        runner(request["code"], limits, isolated, out_w, err_w)
    _call["runner"] = pid
    os.close(out_w)
    os.close(err_w)
    cap = request["max_output_bytes"]
    captured = {out_r: bytearray(), err_r: bytearray()}
    total = {out_r: 0, err_r: 0}
    selector = selectors.DefaultSelector()
    for fd in captured:
        selector.register(fd, selectors.EVENT_READ)
    deadline = start + request["timeout"]
    timed_out, status, ended_at = False, None, None
    while selector.get_map():
        now = time.monotonic()
        if status is None:
            waited, raw = os.waitpid(pid, os.WNOHANG)
            if waited:
                status, ended_at = raw, now
            elif now >= deadline:
                timed_out = True
                _kill_runner(pid, isolated)
                _, status = os.waitpid(pid, 0)
                ended_at = time.monotonic()
        # once the runner is gone, wait briefly for descendants (being killed) to close the pipes
        if ended_at is not None and now - ended_at > 1.0:
            break
        for key, _ in selector.select(timeout=0.02):
            chunk = os.read(key.fd, 65536)
            if not chunk:
                selector.unregister(key.fd)
                continue
            total[key.fd] += len(chunk)
            room = cap - len(captured[key.fd])
            if room > 0:
                captured[key.fd] += chunk[:room]
    if status is None:
        _, status = os.waitpid(pid, 0)
    if not isolated:
        _kill_runner(pid, isolated)  # whatever is left of its process group
        shutil.rmtree(workdir, ignore_errors=True)
    response = {
        "stdout": captured[out_r].decode("utf-8", "replace"),
        "stderr": captured[err_r].decode("utf-8", "replace"),
        "stdout_bytes": total[out_r],
        "stderr_bytes": total[err_r],
        "exit_code": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
        "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
        "timed_out": timed_out,
        "seconds": time.monotonic() - start,
    }
    _send(conn, response)


def _kill_runner(pid, isolated):
    try:
        if isolated:
            os.kill(pid, signal.SIGKILL)  # PID 1 of its namespace: the kernel kills the rest
        else:
            os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


# ---------------------------------------------------------------------------------------------
# Main loop


def _reap(*_):
    try:
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass
    except ChildProcessError:
        pass


def _stop(*_):
    raise SystemExit(0)  # SIGTERM in the server: shut down as on EOF


def _remove_tree(dir_fd, name):
    """``rm -rf name`` relative to dir_fd: after pivot_root this process no longer sees the path."""
    try:
        os.unlink(name, dir_fd=dir_fd)
    except IsADirectoryError:
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dir_fd)
        try:
            for entry in os.listdir(fd):
                with contextlib.suppress(OSError):
                    _remove_tree(fd, entry)
        finally:
            os.close(fd)
        os.rmdir(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass


def _shut_down(parent_fd, name):
    """Stop the calls in flight, then remove this server's directory (see the module docstring)."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # the handlers are in this server's process group (their runners start their own sessions)
    os.killpg(0, signal.SIGTERM)
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                time.sleep(0.01)
        except ChildProcessError:
            break
    with contextlib.suppress(OSError):
        _remove_tree(parent_fd, name)


def serve(args, own_dir, parent_fd, server_pid):
    gc.disable()
    for name in filter(None, args.preload.split(",")):
        try:
            __import__(name)
        except Exception:  # preloading is an optimisation: a missing module is imported on use
            pass
    # Keep the preloaded objects out of the garbage collector's reach: a collection in a forked
    # child would touch every object and copy the whole heap page by page.
    gc.freeze()
    gc.enable()
    # bound before entering the minimal root, where the host's socket path is not visible; bound
    # under another name and renamed once listening, so that a zygote.sock that refuses
    # connections always means a dead server (see sandbox._remove_abandoned_directories)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(os.path.join(own_dir, "zygote.sock.new"))
    listener.listen(256)
    os.rename(os.path.join(own_dir, "zygote.sock.new"), os.path.join(own_dir, "zygote.sock"))
    # the calls' working directories (rlimits) go in this server's directory, removed with it;
    # inside the minimal root that path is out of sight, and /tmp is this server's own tmpfs
    work_parent = own_dir
    isolation, note = "rlimits", ""
    if args.isolation in ("auto", "namespaces"):
        root = os.path.join(own_dir, "root")
        os.mkdir(root)
        try:
            enter_minimal_root(root)
        except OSError as exc:
            note = f"no mount namespace ({exc}): the sandbox sees the host filesystem"
        else:
            work_parent = "/tmp"
            if _namespaces_work():
                isolation = "namespaces"
            else:
                note = "filesystem isolated, but no user/network/PID namespaces"
        if args.isolation == "namespaces" and isolation != "namespaces":
            sys.stdout.write(json.dumps({"ready": False, "error": note}) + "\n")
            sys.exit(1)
    signal.signal(signal.SIGCHLD, _reap)
    sys.stdout.write(json.dumps({"ready": True, "isolation": isolation, "note": note, "pid": server_pid}) + "\n")
    sys.stdout.flush()

    def server_alive():
        return os.getppid() == server_pid

    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, "accept")
    selector.register(sys.stdin, selectors.EVENT_READ, "parent")  # EOF: the host went away
    while True:
        for key, _ in selector.select():
            if key.data == "parent":
                if not sys.stdin.buffer.read1(4096):
                    return
                continue
            conn, _ = listener.accept()
            pid = os.fork()
            if pid == 0:
                status = 1
                try:
                    signal.signal(signal.SIGTERM, _end_call)
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    listener.close()
                    os.close(parent_fd)  # a descriptor of a host directory must not reach the sandbox
                    _die_with_parent(signal.SIGTERM, server_alive)
                    handle(conn, isolation, work_parent, server_alive)
                    status = 0
                except BaseException:
                    try:
                        _send(conn, {"error": "sandbox failure: " + traceback.format_exc(limit=3)})
                    except OSError:
                        pass
                finally:
                    os._exit(status)
            conn.close()


def main():
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True, help="an empty directory for the socket and the minimal root; removed on exit")
    parser.add_argument("--isolation", choices=["auto", "namespaces", "rlimits"], default="auto")
    parser.add_argument("--preload", default="")
    args = parser.parse_args()

    server_pid = os.getpid()
    if os.getpgrp() != server_pid:
        os.setsid()  # see the module docstring; a process group leader already has its own group
    own_dir = os.path.abspath(args.dir)
    # kept open to remove the directory from inside the minimal root
    parent_fd = os.open(os.path.dirname(own_dir), os.O_RDONLY | os.O_DIRECTORY)
    signal.signal(signal.SIGTERM, _stop)
    try:
        serve(args, own_dir, parent_fd, server_pid)
    finally:
        if os.getpid() == server_pid:  # not in a child that a signal caught before it reset its handlers
            _shut_down(parent_fd, os.path.basename(own_dir))


if __name__ == "__main__":
    main()
