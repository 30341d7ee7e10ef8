"""Shared helpers for the dtrain-run launcher tests (Python 3 stdlib only).

The launcher binary comes from the DTRAIN_RUN environment variable (set by ctest from
$<TARGET_FILE:dtrain-run>). Workers are shell / python one-liners, so no LibTorch is needed.
Every process started here is bounded by a timeout.
"""
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "common"))
import proc_util  # noqa: E402
from proc_util import (alive, free_port, free_slurm_job_id, slurm_job_port, thread_states,  # noqa: E402
                       wait_until)  # (re-exported)

DTRAIN_RUN = os.environ.get("DTRAIN_RUN", "")
PY = sys.executable  # the interpreter running the tests, also used for python workers
TIMEOUT = 30  # seconds any single launcher run may take


def require_launcher(test):
    if not DTRAIN_RUN:
        raise unittest.SkipTest("set DTRAIN_RUN to the dtrain-run binary (ctest does this)")
    # ctest sets DTRAIN_RUN to the built target: a path without a program is a broken build, not a skip.
    test.assertTrue(os.access(DTRAIN_RUN, os.X_OK),
                    f"DTRAIN_RUN={DTRAIN_RUN} is not an executable file: build the dtrain-run target")


def clean_env(**extra):
    """proc_util.clean_env's environment (no launcher variables) without OMP_NUM_THREADS, which the
    launcher itself sets for its workers, plus `extra`."""
    return proc_util.clean_env(omp_threads=None, **extra)


# A job secret for tests whose launchers share one (tools/dtrain-run/secret.h): without it a launcher
# of several nodes prints a line saying its store is open, which tests of other lines would count.
SECRET = "launcher-tests-job-secret-0123456789abcdef"


def with_secret(**extra):
    """clean_env(**extra) with the launchers' shared SECRET."""
    return clean_env(DTRAIN_JOB_SECRET=SECRET, **extra)


def run(args, env=None, timeout=TIMEOUT, **kw):
    """Runs dtrain-run with `args`; returns CompletedProcess with text stdout/stderr."""
    return subprocess.run([DTRAIN_RUN] + [str(a) for a in args], env=env or clean_env(),
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=timeout, **kw)


def start(args, env=None, **kw):
    """Starts dtrain-run in the background, in its own session (caller must finish or kill it); its
    stdout and stderr are pipes unless `kw` gives them."""
    kw.setdefault("start_new_session", True)
    kw.setdefault("stdout", subprocess.PIPE)
    kw.setdefault("stderr", subprocess.PIPE)
    return subprocess.Popen([DTRAIN_RUN] + [str(a) for a in args], env=env or clean_env(), text=True, **kw)


def finish(*procs, timeout=40):
    """Waits for every launcher; one still running at `timeout` is killed with its whole session (its
    workers too), and its stderr says so. Returns [(rc, out, err)]."""
    results = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc_util.kill_session(p)
            out, err = p.communicate()
            err = (err or "") + proc_util.timeout_note(timeout)  # None: stderr went to a file
        results.append((p.returncode, out, err))
    return results


def pids_with_marker(marker):
    """Pids of live (non-zombie) processes that have `marker` as one whole argument (not the
    launcher, whose own command line names it too, and not a shell whose script mentions it)."""
    found = []
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == os.getpid():
            continue
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        argv = cmd.split(b"\0")
        if marker.encode() in argv and not argv[0].endswith(b"dtrain-run") and alive(d):
            found.append(int(d))
    return found


def kill_marker(marker):
    """Best-effort cleanup so a failed test leaves nothing behind."""
    for pid in pids_with_marker(marker):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


class MarkedTestCase(unittest.TestCase):
    """A launcher test with a scratch folder (self.tmp, prefix tmp_prefix) and a marker (self.marker)
    that its long-lived workers carry as an argument, so that tearDown kills any a failure left behind."""
    tmp_prefix = "dtrain_launcher_"

    def setUp(self):
        require_launcher(self)
        self.tmp = tempfile.mkdtemp(prefix=self.tmp_prefix)
        self.marker = f"dtrainmark{os.getpid()}x{time.monotonic_ns()}"

    def tearDown(self):
        kill_marker(self.marker)
        shutil.rmtree(self.tmp, ignore_errors=True)


def run_folder(log_dir, run_id="none"):
    """The one folder a run made under --log_dir: torchrun's <log_dir>/<run_id>_<random>."""
    import glob
    found = glob.glob(os.path.join(glob.escape(log_dir), glob.escape(run_id) + "_*"))
    assert len(found) == 1, f"expected one {run_id}_* folder in {log_dir}, found {found}"
    return found[0]


def port_open(port):
    """Whether something accepts connections on 127.0.0.1:port (a launcher's store has come up)."""
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def listeners(port):
    """Local addresses (hex, as in /proc/net/tcp) listening on `port`."""
    out = []
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(path) as f:
                next(f)
                for line in f:
                    parts = line.split()
                    addr, p = parts[1].split(":")
                    if parts[3] == "0A" and int(p, 16) == port:
                        out.append(addr)
        except OSError:
            pass
    return out
