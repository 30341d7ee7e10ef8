"""Helpers that the Python test suites in tests/dist and tests/launcher share (stdlib only)."""
import fcntl
import os
import random
import signal
import socket
import struct
import subprocess
import time

# Variables a launcher may have put in the tests' own environment (a suite run under srun, mpirun or
# torchrun): every test controls them explicitly, so clean_env() drops them.
_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RUN_ID")
_LAUNCH_PREFIXES = ("OMPI_", "PMI_", "PMIX_", "MPI_LOCAL", "SLURM_", "DTRAIN_", "TORCHELASTIC_")


def clean_env(omp_threads="1", **extra):
    """os.environ without any launcher variables (nor DTRAIN_*), with OMP_NUM_THREADS=omp_threads
    (None: unset, for a test of what the launcher itself sets), plus `extra` (a None value deletes).
    The one rule both suites use: tests/dist starts ranks with one thread each, tests/launcher starts
    dtrain-run."""
    env = {k: v for k, v in os.environ.items()
           if k not in _LAUNCH_VARS and not k.startswith(_LAUNCH_PREFIXES)}
    env.pop("OMP_NUM_THREADS", None)
    if omp_threads is not None:
        env["OMP_NUM_THREADS"] = str(omp_threads)
    for k, v in extra.items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = str(v)
    return env


def free_port():
    """A TCP port on 127.0.0.1 that was free a moment ago (bind port 0, read it, close; a tiny race,
    acceptable in tests)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    """A random job id such that the ports derived from it and the next count-1 ids are free, so that a
    test whose job meets at the derived port does not meet another program (or a second copy of the
    suite) there."""
    for _ in range(200):
        first = random.randrange(100000, 900000)
        if all(port_is_free(slurm_job_port(first + i)) for i in range(count)):
            return first
    raise AssertionError(f"no run of {count} free ports in 15000-24999 on 127.0.0.1")


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


# One kill rule for both suites: every process a test starts runs in its own session, and a process
# past its timeout is SIGKILLed with that whole session (a launcher's workers too, marked or not), and
# its output says so.
def kill_session(p):
    """SIGKILL the session of Popen `p` (started with start_new_session=True), even after it exited."""
    p.poll()
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    p.wait()


def timeout_note(timeout):
    """The line a killed process's stderr ends with."""
    return f"\n[harness] killed after {timeout:.0f} s timeout\n"
