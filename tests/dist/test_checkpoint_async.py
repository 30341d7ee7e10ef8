"""CheckpointManager::save_async killed mid-write (SIGKILL while its thread writes a 256 MiB state):
the previous checkpoint is intact and load_latest resumes from it; the next save sweeps the
temporary file the killed write left.

Env: $CHECKPOINT_ASYNC_TOOL (checkpoint_async_tool.cpp, set by tests/dist/CMakeLists.txt).
"""
import os
import shutil
import signal
import subprocess
import tempfile
import time
import unittest

from harness import binary

MIB = 256


class AsyncSaveKilled(unittest.TestCase):
    def test_a_kill_during_the_write_leaves_the_previous_checkpoint_the_latest(self):
        tool = binary("CHECKPOINT_ASYNC_TOOL", "checkpoint_async_tool")
        folder = tempfile.mkdtemp(prefix="dtrain_async_kill_")
        self.addCleanup(shutil.rmtree, folder, True)
        p = subprocess.Popen([tool, "save", folder, str(MIB)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
        try:
            self.assertEqual(p.stdout.readline().strip(), "staged", p.stderr.read() if p.poll() is not None else "")
            # Wait until the thread's temporary file has some bytes but the checkpoint is not complete.
            deadline = time.monotonic() + 60
            temps = []
            while time.monotonic() < deadline:
                temps = [f for f in os.listdir(folder) if "0000000002" in f and f != "checkpoint_0000000002.pt"]
                if temps and os.path.getsize(os.path.join(folder, temps[0])) > (1 << 20):
                    break
                self.assertFalse(os.path.exists(os.path.join(folder, "checkpoint_0000000002.pt")),
                                 "the write finished before the test could kill it: raise MIB")
                time.sleep(0.005)
            self.assertTrue(temps, f"no temporary file appeared: {os.listdir(folder)}")
            os.kill(p.pid, signal.SIGKILL)
        finally:
            p.kill()
            p.wait(30)
        self.assertNotIn("checkpoint_0000000002.pt", os.listdir(folder))
        out = subprocess.run([tool, "load", folder, str(MIB)], capture_output=True, text=True, timeout=120)
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertEqual(out.stdout.strip(), "loaded step 1", out.stderr)
        # A later save in the folder sweeps what the killed write left.
        out = subprocess.run([tool, "save_and_wait", folder, str(MIB)], capture_output=True, text=True, timeout=120)
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertFalse([f for f in os.listdir(folder) if f.startswith(".")], os.listdir(folder))


if __name__ == "__main__":
    unittest.main()
