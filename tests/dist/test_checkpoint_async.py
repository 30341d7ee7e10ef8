"""CheckpointManager::save_async killed mid-write (while its thread writes a 256 MiB state):
the previous checkpoint is intact and load_latest resumes from it; the next save sweeps the
temporary file the killed write left. A background write that fails makes the next call throw on
every rank of the job, naming the file.

Env: $CHECKPOINT_ASYNC_TOOL (checkpoint_async_tool.cpp, set by tests/dist/CMakeLists.txt).
"""
import os
import resource
import shutil
import signal
import subprocess
import tempfile
import unittest

from harness import binary, free_port, rank_env, wait_until

MIB = 256
LIMIT = 8 << 20  # bytes of step 2's checkpoint the tool may write when the test cuts its write there


def stopped(pid):
    """Whether every thread of `pid` has stopped (SIGSTOP): then none is inside a system call."""
    try:
        states = []
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                states.append(f.read().rsplit(")", 1)[1].split()[0])
    except OSError:
        return False
    return bool(states) and all(st in "Tt" for st in states)


def no_core_dumps():
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


class AsyncSaveKilled(unittest.TestCase):
    def kill_during_the_write(self, tool, folder):
        """Runs `tool save` and kills it while its thread writes step 2's checkpoint; returns how, or
        None when the write had finished before the test could stop the process (try again).

        No race against the write: once the tool says "staged", it is stopped (SIGSTOP) and looked at
        while it cannot move. If the temporary file is there, the thread is between creating it and
        renaming it: SIGKILL. If not, the write has not begun: the process may write no file beyond
        LIMIT bytes (RLIMIT_FSIZE) and goes on; the write stops at LIMIT bytes, and the next write()
        kills the process with SIGXFSZ, as abruptly as SIGKILL (no handler; no core: RLIMIT_CORE 0)."""
        final = os.path.join(folder, "checkpoint_0000000002.pt")
        p = subprocess.Popen([tool, "save", folder, str(MIB)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, preexec_fn=no_core_dumps)
        try:
            self.assertEqual(p.stdout.readline().strip(), "staged", p.stderr.read() if p.poll() is not None else "")
            os.kill(p.pid, signal.SIGSTOP)
            self.assertTrue(wait_until(lambda: stopped(p.pid), 30), "the tool did not stop")
            if os.path.exists(final):
                return None
            if self.temps(folder):
                os.kill(p.pid, signal.SIGKILL)
                p.wait(30)
                return "SIGKILL after the temporary file appeared"
            resource.prlimit(p.pid, resource.RLIMIT_CORE, (0, 0))
            try:  # where cores go to a program, which RLIMIT_CORE does not stop: only its headers
                with open(f"/proc/{p.pid}/coredump_filter", "w") as f:
                    f.write("0")
            except OSError:
                pass
            resource.prlimit(p.pid, resource.RLIMIT_FSIZE, (LIMIT, LIMIT))
            os.kill(p.pid, signal.SIGCONT)
            rc = p.wait(120)
            self.assertEqual(rc, -signal.SIGXFSZ, p.stderr.read())
            temps = self.temps(folder)
            self.assertEqual([os.path.getsize(os.path.join(folder, t)) for t in temps], [LIMIT], temps)
            return f"SIGXFSZ after {LIMIT} bytes"
        finally:
            p.kill()
            p.wait(30)
            p.stdout.close()
            p.stderr.close()

    @staticmethod
    def temps(folder):
        """The temporary files of step 2's checkpoint (CheckpointManager writes beside the target)."""
        return [f for f in os.listdir(folder) if "0000000002" in f and f != "checkpoint_0000000002.pt"]

    def test_a_kill_during_the_write_leaves_the_previous_checkpoint_the_latest(self):
        tool = binary("CHECKPOINT_ASYNC_TOOL", "checkpoint_async_tool")
        folder = tempfile.mkdtemp(prefix="dtrain_async_kill_")
        self.addCleanup(shutil.rmtree, folder, True)
        # The write ends before the test stops the tool only if the test sleeps through all of it (256
        # MiB serialized, written and synced): then the run says nothing, and the test runs it again.
        how = None
        for _ in range(5):
            how = self.kill_during_the_write(tool, folder)
            if how:
                break
            shutil.rmtree(folder)
            os.mkdir(folder)
        self.assertTrue(how, "the write finished before the test could stop the tool, 5 times")
        self.assertTrue(self.temps(folder), f"{how}: no temporary file: {os.listdir(folder)}")
        self.assertNotIn("checkpoint_0000000002.pt", os.listdir(folder))
        out = subprocess.run([tool, "load", folder, str(MIB)], capture_output=True, text=True, timeout=120)
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertEqual(out.stdout.strip(), "loaded step 1", out.stderr)
        # A later save in the folder sweeps what the killed write left.
        out = subprocess.run([tool, "save_and_wait", folder, str(MIB)], capture_output=True, text=True, timeout=120)
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertFalse([f for f in os.listdir(folder) if f.startswith(".")], os.listdir(folder))

    def test_a_failed_background_write_fails_the_next_call_on_every_rank(self):
        tool = binary("CHECKPOINT_ASYNC_TOOL", "checkpoint_async_tool")
        folder = tempfile.mkdtemp(prefix="dtrain_async_fail_")
        self.addCleanup(shutil.rmtree, folder, True)
        port = free_port()
        procs = [subprocess.Popen([tool, "fail", folder, "1"], env=rank_env(r, 2, port, DTRAIN_TIMEOUT_S=60),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
        for r, p in enumerate(procs):
            out, err = p.communicate(timeout=120)
            self.assertEqual(p.returncode, 1, err)
            lines = [l for l in err.splitlines() if l.startswith("checkpoint_async_tool: ")]
            self.assertEqual(len(lines), 1, err)
            self.assertIn("asynchronous save of " + folder + "/checkpoint_0000000002.pt failed", lines[0])
            if r == 1:
                self.assertIn("rank 0's asynchronous save", lines[0])


if __name__ == "__main__":
    unittest.main()
