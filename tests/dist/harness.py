"""Shared helpers for dtrain's process-level tests (Python 3 stdlib only).

Every test starts real processes: ranks of build/bin/hello_distributed (or another program) with an
environment built here, collects their output, and kills every process it started when a test fails
or times out. Binary paths come from environment variables set by tests/dist/CMakeLists.txt:

  HELLO              hello_distributed
  COLLECTIVES_TEST   collectives_test
  DTRAIN_RUN         dtrain-run (the launcher)

A variable that is set must name an existing program (else the test fails); one that is unset makes
the test look under build*/bin and skip when nothing is there (a run by hand before any build).
  DTRAIN_BUILD_DIR   the CMake build tree (for `cmake --install`)

Run one file by hand:  cd tests/dist && HELLO=../../build/bin/hello_distributed python3 -m unittest -v test_init_methods
"""
import glob
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import unittest
from dataclasses import dataclass

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "common"))
# Re-exported to the dist tests.
from proc_util import (alive, children, clean_env, free_port, free_slurm_job_id,  # noqa: E402
                       keep_outputs, kill_session, scaled, slurm_job_port, time_scale, timeout_note, wait_unreaped,
                       wait_until)

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

# Seconds any single process may run before the harness kills it (a hang is a failure, never a stall).
PROC_TIMEOUT_S = 60

def binary(var, name):
    """Path of a built program: $var, else build*/bin/<name> under the repository; None if absent.

    A $var that names no executable fails the test: CMake sets it only for a target of this build,
    so the program should have been built, and skipping would let a broken build pass."""
    path = os.environ.get(var)
    if path:
        if not os.access(path, os.X_OK):
            raise AssertionError(f"{var}={path} is not an executable file: CMake set it for the target "
                                 f"{name}, which should have been built (cmake --build <build dir>)")
        return path
    found = sorted(glob.glob(os.path.join(ROOT, "build*", "bin", name)), key=os.path.getmtime)
    return found[-1] if found else None


def hello():
    path = binary("HELLO", "hello_distributed")
    if not path:
        raise unittest.SkipTest("hello_distributed is not built: build the project first, or set HELLO")
    return path


def trainer():
    path = binary("TRAIN_FASHION_MNIST", "train_fashion_mnist")
    if not path:
        raise unittest.SkipTest("train_fashion_mnist is not built (set TRAIN_FASHION_MNIST)")
    return path


def launcher():
    path = binary("DTRAIN_RUN", "dtrain-run")
    if not path:
        raise unittest.SkipTest("dtrain-run is not built (tools/dtrain-run; or set DTRAIN_RUN): "
                                "the tests that run the launcher are skipped")
    return path


def rank_env(rank, world, port, addr="127.0.0.1", **extra):
    return clean_env(RANK=rank, WORLD_SIZE=world, MASTER_ADDR=addr, MASTER_PORT=port, **extra)


def port_was_taken(result):
    """Whether a rank failed because its store's port was in use (dtrain's or PyTorch's TCPStore): the
    port free_port() gave is reserved among test processes, but any other program may bind it first."""
    return result.rc != 0 and ("EADDRINUSE" in result.err or "already in use" in result.err.lower())


@dataclass
class Result:
    argv: list
    rc: int
    out: str
    err: str
    seconds: float

    def __str__(self):
        return (f"$ {' '.join(map(str, self.argv))}\nexit {self.rc} after {self.seconds:.1f} s\n"
                f"--- stdout\n{self.out}--- stderr\n{self.err}")


class Proc:
    """A started process in its own session (so the harness can kill it and its children)."""

    def __init__(self, argv, env=None, stdin=subprocess.DEVNULL, cwd=None):
        self.argv = [str(a) for a in argv]
        self.start = time.monotonic()
        # Files, not pipes: a rank blocked on a full pipe could stall its peers.
        self._out, self._err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        self.p = subprocess.Popen(self.argv, env=env, stdin=stdin, stdout=self._out, stderr=self._err,
                                  start_new_session=True, cwd=cwd)
        self.pid = self.p.pid

    def ended(self):
        """Whether the process has exited; it is not waited for here, so that kill() can still
        signal its group by its number (proc_util.kill_session)."""
        return wait_unreaped(self.p, 0)

    def kill(self):
        """SIGKILL the process's group, even after it exited, and wait for it (proc_util.kill_session).
        A launcher's workers, in groups of their own, die with the launcher (PR_SET_PDEATHSIG)."""
        kill_session(self.p)

    def close(self):
        self.kill()
        if self.p.stdin:
            self.p.stdin.close()
        # What it wrote, for DistTestCase to keep if the test failed (the files go away here).
        self.kept = (self.argv, self.p.returncode, self.read(self._out), self.read(self._err))
        self._out.close()
        self._err.close()

    @staticmethod
    def read(f):
        f.seek(0)
        return f.read()

    def output(self):
        """stdout so far (the process may still be running)."""
        return self.read(self._out)

    def finish(self, timeout):
        """Wait up to `timeout` s; a process still running then is killed and reported as rc -9."""
        note = ""
        if not wait_unreaped(self.p, max(0.1, timeout)):
            note = timeout_note(timeout)
        self.kill()  # what it left in its group too; then waited for
        out, err = self.read(self._out), self.read(self._err) + note
        return Result(self.argv, self.p.returncode, out, err, time.monotonic() - self.start)


# A sanitizer's report in a process's stderr (scripts/sanitize.sh runs some of these tests on
# instrumented programs): ThreadSanitizer, AddressSanitizer, LeakSanitizer, and UBSan's
# "file.cpp:line:col: runtime error:". Such a report fails the test even where the process's exit
# status was not checked (a rank the test killed, or one expected to fail).
SANITIZER_REPORT = re.compile(r"WARNING: ThreadSanitizer:|ERROR: (?:Address|Leak)Sanitizer:|\.(?:cpp|h):\d+:\d+: runtime error:")


class DistTestCase(unittest.TestCase):
    """Starts processes, always kills them at the end of the test, and checks their results."""

    maxDiff = None

    def run(self, result=None):
        """Runs the test; if it failed, keeps the whole output of every process it spawned
        (proc_util.keep_outputs) and prints where."""
        if result is None:
            result = self.defaultTestResult()
        self._procs = []

        def failed():
            return len(result.failures) + len(result.errors) + len(getattr(result, "unexpectedSuccesses", ()))
        before = failed()
        try:
            return super().run(result)
        finally:
            kept = [p.kept for p in self._procs if hasattr(p, "kept")]
            reports = [f"$ {' '.join(argv)}: {line}" for argv, _, _, err in kept for line in err.splitlines()
                       if SANITIZER_REPORT.search(line)]
            if reports:
                try:
                    raise AssertionError("a sanitizer reported in the test's processes:\n" + "\n".join(reports[:10]))
                except AssertionError:
                    result.addFailure(self, sys.exc_info())
            if failed() > before and kept:
                try:
                    folder = keep_outputs(self.id(), kept)
                    print(f"\n[harness] {self.id()} failed: the output of its {len(kept)} process(es) is in {folder}",
                          file=sys.stderr, flush=True)
                except OSError as e:
                    print(f"\n[harness] could not keep the failed test's outputs: {e}", file=sys.stderr, flush=True)

    def spawn(self, argv, env=None, **kw):
        proc = Proc(argv, env, **kw)
        self.addCleanup(proc.close)
        if hasattr(self, "_procs"):
            self._procs.append(proc)
        return proc

    def run_ranks(self, argv, envs, timeout=PROC_TIMEOUT_S, stagger_s=0.0):
        """Start one process per env in `envs` (same argv) and wait for all; returns [Result]."""
        procs = []
        for env in envs:
            procs.append(self.spawn(argv, env))
            if stagger_s:
                time.sleep(stagger_s)
        deadline = time.monotonic() + timeout
        results = []
        for proc in procs:
            results.append(proc.finish(deadline - time.monotonic()))
        return results

    @staticmethod
    def finish_all(procs, timeout=PROC_TIMEOUT_S, give_up=None):
        """Waits for every Proc of `procs` up to `timeout` s in all; returns their [Result]. Once one
        has ended with a Result for which give_up(result) is true, the others are killed at once (a
        peer of a rank that could not start may wait for it until its own timeout)."""
        deadline = time.monotonic() + timeout
        while give_up and time.monotonic() < deadline:
            ended = [proc for proc in procs if proc.ended()]
            if len(ended) == len(procs):
                break
            if any(give_up(proc.finish(0)) for proc in ended):
                deadline = time.monotonic()  # the rest: killed now
                break
            time.sleep(0.05)
        return [proc.finish(deadline - time.monotonic()) for proc in procs]

    def run_world(self, argvs, timeout=240, **env):
        """The "against PyTorch" harnesses' job: `argvs[r]` on rank r of len(argvs) ranks (env://, a
        free port, PYTHONPATH unset, `env` added; each rank's program may differ, Python or C++), again
        on another port if a program outside the tests took it. Returns the ranks' [Result] and the
        port they ran on."""
        world = len(argvs)
        for _ in range(3):
            port = free_port()
            procs = [self.spawn(argvs[r], rank_env(r, world, port, LOCAL_RANK=r, LOCAL_WORLD_SIZE=world,
                                                   PYTHONPATH=None, **env))
                     for r in range(world)]
            results = self.finish_all(procs, timeout, give_up=port_was_taken)
            if not any(map(port_was_taken, results)):
                break
        return results, port

    def run_against_python(self, var, program, script, world, **env):
        """A C++ program and its Python reference (tests/dist/<script>, run by .venv's Python 2.x) on
        `world` ranks each, every rank writing one JSON: returns (Python's, C++'s), lists by rank.
        Skips the test when .venv's Python is missing; $var names the program (binary())."""
        python = os.environ.get("VENV_PYTHON", "")
        if not python or not os.access(python, os.X_OK):
            raise unittest.SkipTest(f".venv's python is missing ({python!r}): run scripts/setup.sh")
        cxx = binary(var, program)
        with tempfile.TemporaryDirectory() as folder:
            outs = {tag: [os.path.join(folder, f"{tag}{r}.json") for r in range(world)] for tag in ("py", "cxx")}
            py = self.run_ranks_json([python, os.path.join(HERE, script)], world, outs["py"], **env)
            cc = self.run_ranks_json([cxx], world, outs["cxx"], **env)
        return py, cc

    def run_ranks_json(self, argv, world, outs, timeout=240, expect_ok=True, **env):
        """run_world of `argv + [out]` on `world` ranks. `outs` is one JSON path per rank, or one path
        every rank is given (rank 0 writes it). Returns the JSON of each path (one value for one
        path); with expect_ok=False the ranks' [Result]."""
        paths = outs if isinstance(outs, list) else [outs] * world
        results, _ = self.run_world([argv + [paths[r]] for r in range(world)], timeout, **env)
        if not expect_ok:
            return results
        for r, res in enumerate(results):
            self.assertEqual(res.rc, 0, f"rank {r} of {world}:\n{res}")
        loaded = []
        for path in (outs if isinstance(outs, list) else [outs]):
            with open(path) as f:
                loaded.append(json.load(f))
        return loaded if isinstance(outs, list) else loaded[0]

    def run_one(self, argv, env, timeout=PROC_TIMEOUT_S, **kw):
        return self.spawn(argv, env, **kw).finish(timeout)

    def spawn_python_store(self, script, port):
        """Run a Python script (given the port) that hosts a torch TCPStore and prints "ready"; it
        runs until its stdin is closed. The Python is $STORE_PYTHON: one whose PyTorch speaks the store
        protocol of the LibTorch this tree was built against (/usr/bin/python3's 1.13 by default, the
        venv's 2.x for a 2.x tree). Skips the test when that Python has no torch."""
        python = os.environ.get("STORE_PYTHON", "/usr/bin/python3")
        store = self.spawn([python, "-c", script, port], clean_env(PYTHONPATH=None), stdin=subprocess.PIPE)
        for _ in range(300):
            if "ready" in store.output() or store.ended():
                break
            time.sleep(0.1)
        if "ready" not in store.output():
            res = store.finish(1)
            if "No module named 'torch'" in res.err:
                self.skipTest(f"torch is not installed for {python}")
            self.fail(f"the Python TCPStore did not start:\n{res}")
        return store

    # --- checks ---------------------------------------------------------------------------------
    def assertPassed(self, results, world, marker="all_reduce check passed"):
        for r in results:
            self.assertEqual(r.rc, 0, f"a rank failed:\n{r}")
            self.assertIn(f"{marker}: sum of (rank+1) over {world} ranks", r.out, str(r))

    def assertOneLineError(self, result, *needles, prefix="hello_distributed: error:"):
        """Exit code != 0 and stderr has exactly one line starting with `prefix`, containing needles."""
        self.assertNotEqual(result.rc, 0, f"expected a failure:\n{result}")
        self.assertNotEqual(result.rc, -9, f"the process hung and was killed:\n{result}")
        lines = [l for l in result.err.splitlines() if l.startswith(prefix)]
        self.assertEqual(len(lines), 1, f"expected exactly one '{prefix}' line:\n{result}")
        for needle in needles:
            self.assertIn(needle, lines[0], f"the error line lacks {needle!r}:\n{result}")
        return lines[0]
