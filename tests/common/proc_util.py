"""Helpers that the Python test suites in tests/dist and tests/launcher share (stdlib only)."""
import atexit
import errno
import fcntl
import os
import random
import select
import shutil
import signal
import socket
import stat
import struct
import subprocess
import tempfile
import time

# Variables a launcher may have put in the tests' own environment (a suite run under srun, mpirun or
# torchrun): every test controls them explicitly, so clean_env() drops them.
_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RUN_ID")
_LAUNCH_PREFIXES = ("OMPI_", "PMI_", "PMIX_", "MPI_LOCAL", "SLURM_", "DTRAIN_", "TORCHELASTIC_")


_children_tmpdir = None


def children_tmpdir():
    """The TMPDIR clean_env() gives children: a folder of this test process, removed when it exits.
    A launcher or rank that a test kills cannot remove what it made there (dtrain-run's temporary
    flight folder, its --tee logs), and a shared /tmp would keep it from every run."""
    global _children_tmpdir
    if _children_tmpdir is None:
        _children_tmpdir = tempfile.mkdtemp(prefix="dtrain-test-tmp-")
        atexit.register(shutil.rmtree, _children_tmpdir, True)
    return _children_tmpdir


def clean_env(omp_threads="1", **extra):
    """os.environ without any launcher variables (nor DTRAIN_*), with OMP_NUM_THREADS=omp_threads
    (None: unset, for a test of what the launcher itself sets), TMPDIR=children_tmpdir(), plus
    `extra` (a None value deletes). The one rule both suites use: tests/dist starts ranks with one
    thread each, tests/launcher starts dtrain-run."""
    env = {k: v for k, v in os.environ.items()
           if k not in _LAUNCH_VARS and not k.startswith(_LAUNCH_PREFIXES)}
    env["TMPDIR"] = children_tmpdir()
    env.pop("OMP_NUM_THREADS", None)
    if omp_threads is not None:
        env["OMP_NUM_THREADS"] = str(omp_threads)
    for k, v in extra.items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = str(v)
    return env


# Ports. A port found free by binding port 0 and closing comes from the kernel's ephemeral range, where
# any process's next outgoing connection (another test's Gloo pairs, a client of its store) may take it
# before the rank that was given it binds it; and two test processes (ctest -j) may be handed the same
# one. So the ports handed out here lie outside the ephemeral range, and each is claimed with an
# exclusive flock(2) on a file named after it in _PORT_LOCK_DIR, held until this process exits: no two
# live test processes hold one port, whatever they bind. The kernel drops the locks of a process that
# dies, so nothing needs cleaning up. A claimed port must also bind now (nothing else uses it).
_PORT_LOCK_DIR = f"/tmp/dtrain-test-ports-{os.getuid()}"
_SLURM_PORTS = range(15000, 25000)  # slurm_job_port's range, left to free_slurm_job_id
_claimed = {}  # port -> the open lock file that holds it (for the life of this process)


def _lock_dir():
    try:
        os.mkdir(_PORT_LOCK_DIR, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(_PORT_LOCK_DIR)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise AssertionError(f"{_PORT_LOCK_DIR} is not a folder of this user's: remove it")
    return _PORT_LOCK_DIR


def _bindable(port):
    """Whether `port` can be bound now on every IPv4 address (and IPv6 where there is any)."""
    families = [(socket.AF_INET, "0.0.0.0")]
    if socket.has_ipv6:
        families.append((socket.AF_INET6, "::"))
    for family, any_addr in families:
        try:
            s = socket.socket(family, socket.SOCK_STREAM)
        except OSError:
            continue  # no such protocol here
        with s:
            try:
                s.bind((any_addr, port))
            except OSError as e:
                if family == socket.AF_INET6 and e.errno == errno.EADDRNOTAVAIL:
                    continue  # IPv6 is off: nothing can hold the port there
                return False
    return True


def _claim(ports):
    """Locks every port of `ports` for this process and returns True, or locks none and returns False
    (one is held by another test process or by this one, or cannot be bound now)."""
    if any(p in _claimed for p in ports):
        return False
    held = {}
    try:
        for p in ports:
            fd = os.open(os.path.join(_lock_dir(), str(p)), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                         0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                return False
            held[p] = fd
        if not all(_bindable(p) for p in ports):
            return False
        _claimed.update(held)
        held = {}
        return True
    finally:
        for fd in held.values():
            os.close(fd)  # releases the lock


def _free_port_ranges():
    """Ranges of ports outside the kernel's ephemeral range and slurm_job_port's."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
    except (OSError, ValueError):
        lo, hi = 32768, 60999  # Linux's default
    ranges = [r for r in (range(max(_SLURM_PORTS.stop, 10000), lo), range(hi + 1, 65535),
                          range(10000, min(lo, _SLURM_PORTS.start)))
              if len(r) >= 2]
    return ranges or [range(_SLURM_PORTS.stop, 65535)]  # an ephemeral range over everything: no better choice


def free_port():
    """A TCP port on this machine that no other live test process was given and that binds now; it and
    the port after it are this process's until it exits (a test may use port + 1 as well). Not from
    the ephemeral range, so no process's outgoing connection takes it in the meantime."""
    ports = [p for r in _free_port_ranges() for p in r if p % 2 == 0 and p + 1 in r]
    start = (os.getpid() * 7919) % len(ports)  # concurrent test processes start apart
    for i in range(len(ports)):
        port = ports[(start + i) % len(ports)]
        if _claim([port, port + 1]):
            return port
    raise AssertionError(f"no free pair of ports outside the ephemeral range (locks in {_PORT_LOCK_DIR})")


def port_is_free(port, host="127.0.0.1"):
    """Whether `port` on `host` can be bound now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
            return True
        except OSError:
            return False


def slurm_job_port(job_id):
    """The port dtrain derives from a Slurm job id when MASTER_PORT is unset (Lightning's rule)."""
    return 15000 + job_id % 10000


def free_slurm_job_id(count=1):
    """A random job id such that the ports derived from it and the next count-1 ids are free and are
    this process's (claimed as free_port claims its ports), so that a test whose job meets at the
    derived port does not meet another program (or another test process) there."""
    for _ in range(200):
        first = random.randrange(100000, 900000)
        if _claim(sorted({slurm_job_port(first + i) for i in range(count)})):
            return first
    raise AssertionError(f"no run of {count} free ports in 15000-24999 on this machine")


# Time bounds. A bound on how long something takes (a failure noticed within 10 s) is a claim about
# the normal build: under AddressSanitizer or ThreadSanitizer the same code runs several times slower,
# and scripts/sanitize.sh runs tests side by side, so such bounds multiply by time_scale() there, as
# the C++ tests' test_util::kTimeScale does (tests/common/test_util.h). Waits for an event (a deadline
# that only stops a hang) never need it.
SANITIZER_TIME_SCALE = 10.0


def _sanitized_tree(build_dir):
    """True/False: whether the CMake tree `build_dir` builds with DTRAIN_SANITIZE on; None: no tree."""
    try:
        with open(os.path.join(build_dir, "CMakeCache.txt")) as f:
            for line in f:
                if line.startswith("DTRAIN_SANITIZE:"):
                    return line.split("=", 1)[1].strip().upper() not in ("", "OFF", "0", "FALSE", "NO")
    except OSError:
        return None
    return False


def _sanitized_program(path):
    """Whether the program at `path` carries a sanitizer's runtime (its initializer's name)."""
    import mmap
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            return any(m.find(name) >= 0 for name in (b"__asan_init", b"__tsan_init"))
    except (OSError, ValueError):
        return False


_time_scale = None


def time_scale():
    """The factor time bounds multiply by: $DTRAIN_TEST_TIME_SCALE if set, else SANITIZER_TIME_SCALE
    when the programs under test are built with a sanitizer (the tree of $DTRAIN_BUILD_DIR, or of the
    program $DTRAIN_RUN names), else 1."""
    global _time_scale
    if _time_scale is None:
        given = os.environ.get("DTRAIN_TEST_TIME_SCALE")
        if given:
            _time_scale = float(given)
        else:
            sanitized = None
            run = os.environ.get("DTRAIN_RUN", "")
            trees = [os.environ.get("DTRAIN_BUILD_DIR", "")] + ([os.path.dirname(os.path.dirname(run))] if run else [])
            for tree in filter(None, trees):
                sanitized = _sanitized_tree(tree)
                if sanitized is not None:
                    break
            if sanitized is None and run:
                sanitized = _sanitized_program(run)
            _time_scale = SANITIZER_TIME_SCALE if sanitized else 1.0
    return _time_scale


def scaled(seconds):
    """A bound of `seconds` on the normal build, times time_scale()."""
    return seconds * time_scale()


def wait_until(pred, timeout=10.0, step=0.05):
    """Polls pred() every `step` seconds until it is true (returns True) or `timeout` seconds passed
    (returns pred()'s last value)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(step)
    return pred()


def non_loopback_ipv4():
    """An IPv4 address of this machine outside 127.0.0.0/8 (the first interface's that has one), or
    None on a machine with loopback only."""
    siocgifaddr = 0x8915  # ioctl: the interface's IPv4 address
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(s.fileno(), siocgifaddr, struct.pack("256s", name[:15].encode()))
            except OSError:
                continue  # no IPv4 address on this interface
            addr = socket.inet_ntoa(packed[20:24])
            if not addr.startswith("127."):
                return addr
    return None


def proc_stat(pid):
    """(state, ppid) of process `pid` from /proc/<pid>/stat (state "Z": a zombie), or None when it is
    gone. The command name may hold spaces and parentheses: the fields after its last ")" are split."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return fields[0], int(fields[1])


def thread_states(pid):
    """The set of states of `pid`'s threads ({"T"}: every one stopped), empty when it is gone."""
    states = set()
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return states
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                states.add(f.read().rsplit(")", 1)[1].split()[0])
        except OSError:
            pass  # the thread ended meanwhile
    return states


def alive(pid):
    """Whether `pid` runs (a zombie does not count)."""
    st = proc_stat(pid)
    return st is not None and st[0] != "Z"


def children(pid):
    """Live (non-zombie) processes whose parent is `pid`, sorted."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            st = proc_stat(d)
            if st and st[1] == pid and st[0] != "Z":
                out.append(int(d))
    return sorted(out)


# Outputs of failed tests. ctest -j keeps a test's output only in its log, which the next run
# overwrites, and a test's own message may hold only the tail: when a test fails, the whole stdout and
# stderr of each process it started are copied into a folder that outlives the run.
def failed_output_root():
    """$DTRAIN_FAILED_OUTPUT_DIR; else <build tree>/Testing/failed-output (the tree of $DTRAIN_BUILD_DIR,
    or of the program $DTRAIN_RUN names); else <temporary folder>/dtrain-failed-output."""
    given = os.environ.get("DTRAIN_FAILED_OUTPUT_DIR")
    if given:
        return given
    run = os.environ.get("DTRAIN_RUN", "")
    for tree in filter(None, [os.environ.get("DTRAIN_BUILD_DIR", ""), os.path.dirname(os.path.dirname(run))]):
        if os.path.isfile(os.path.join(tree, "CMakeCache.txt")):
            return os.path.join(tree, "Testing", "failed-output")
    import tempfile
    return os.path.join(tempfile.gettempdir(), "dtrain-failed-output")


def keep_outputs(test_id, procs):
    """Writes, for each (argv, rc, stdout, stderr) of `procs`, <n>-<program>.stdout and .stderr into a
    new folder <failed_output_root()>/<test_id>.<time>.<pid>, with commands.txt listing each command
    and its exit status. Returns the folder."""
    import re
    folder = os.path.join(failed_output_root(),
                          f"{test_id}.{time.strftime('%Y%m%d-%H%M%S')}.{os.getpid()}")
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "commands.txt"), "w") as index:
        for n, (argv, rc, out, err) in enumerate(procs):
            name = f"{n:02d}-{re.sub(r'[^A-Za-z0-9_.-]', '_', os.path.basename(str(argv[0])))}"
            for ext, text in (("stdout", out), ("stderr", err)):
                with open(os.path.join(folder, f"{name}.{ext}"), "w") as f:
                    f.write(text)
            index.write(f"{name}: exit {rc}: {' '.join(map(str, argv))}\n")
    return folder


# One kill rule for both suites: every process a test starts runs in its own session, and a process
# past its timeout is SIGKILLed with that whole session (a launcher's workers too, marked or not), and
# its output says so.
def wait_unreaped(p, timeout):
    """Waits up to `timeout` s for Popen `p` to exit without waiting for it (its zombie stays, and with
    it the number of its process group, for kill_session); True when it has exited."""
    if p.returncode is not None:
        return True
    try:
        fd = os.pidfd_open(p.pid)  # readable once the process has exited
    except (AttributeError, OSError):  # no pidfds (kernels before 5.3): waited for, and so never signalled
        try:
            p.wait(timeout=max(0, timeout))
            return True
        except subprocess.TimeoutExpired:
            return False
    try:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        return bool(poller.poll(min(max(0, int(timeout * 1000)), 2**31 - 1)))  # poll's limit in ms
    finally:
        os.close(fd)


def kill_session(p):
    """SIGKILL the process group of Popen `p` (started with start_new_session=True), even after `p`
    exited, then wait for `p`. Until it is waited for, `p`'s zombie keeps the group's number; a `p`
    already waited for is not signalled, since after a wrap of the kernel's pids (pid_max can be
    32768) its number may lead another process's group."""
    if p.returncode is None:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    p.wait()


def timeout_note(timeout):
    """The line a killed process's stderr ends with."""
    return f"\n[harness] killed after {timeout:.0f} s timeout\n"
