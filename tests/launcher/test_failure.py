"""dtrain-run: failure propagation, signal deaths, signal forwarding, no orphans, PDEATHSIG, and no
signal to a process that took an exited worker's pid."""
import os
import shutil
import signal
import subprocess
import time
import unittest

from launcher_common import DTRAIN_RUN, MarkedTestCase, PY, pids_with_marker, run, start, wait_until

# In a pid namespace of its own (pids from 1, and ns_last_pid to choose the next one): rank 1 exits 0
# at once; the next process after it is made to get rank 1's pid if that is free, and to lead a group
# of its own (setsid), as after a wrap of the kernel's pids; then rank 0 fails, and the launcher
# signals every worker's group. Nothing else forks meanwhile (rank 0 waits on a fifo). Prints whether
# the other process lived through it.
REUSED_PID = r"""T=$1 RUN=$2
mkfifo $T/go
$RUN --nproc_per_node 2 --standalone --grace_period 1 sh -c "if [ \"\$RANK\" = 1 ]; then echo \$\$ > $T/pid1; exit 0; fi
  read x < $T/go; exit 3" 2> $T/run.err &
launcher=$!
while [ ! -s $T/pid1 ]; do sleep 0.05; done
p1=$(cat $T/pid1)
while [ -e /proc/$p1/stat ] && [ "$(cut -d' ' -f3 /proc/$p1/stat)" != Z ]; do sleep 0.05; done
sleep 0.5  # the launcher has seen the exit
echo $((p1 - 1)) > /proc/sys/kernel/ns_last_pid || { echo "cannot choose the next pid"; exit 9; }
setsid sleep 30 &
other=$!
while [ "$(cut -d' ' -f5 /proc/$other/stat)" != $other ]; do sleep 0.01; done  # it leads its group
echo go > $T/go
wait $launcher
echo "launcher exit $? rank1 pid $p1 other pid $other"
if kill -0 $other 2>/dev/null; then echo "other lived"; kill $other; else echo "other was killed"; fi
"""

# The harness's kill_session in a pid namespace: a process waited for must not be signalled by its
# number once another process has it; one that exited and was not waited for (wait_unreaped) is
# killed with what it left in its group.
HARNESS_REUSE = r"""import os, signal, subprocess, sys, time
sys.path.insert(0, sys.argv[1])
from proc_util import kill_session, wait_unreaped

p = subprocess.Popen(["true"], start_new_session=True)
p.wait()
with open("/proc/sys/kernel/ns_last_pid", "w") as f:  # the next process gets p's pid, free again
    f.write(str(p.pid - 1))
other = subprocess.Popen(["sleep", "30"], start_new_session=True)  # and leads a group of its own
kill_session(p)
try:  # a SIGKILL takes a moment to land
    other.wait(timeout=1)
except subprocess.TimeoutExpired:
    pass
print(f"waited: pid taken again {other.pid == p.pid}, other lived {other.returncode is None}", flush=True)
other.kill(); other.wait()

p = subprocess.Popen(["sh", "-c", "sleep 30 & echo $!"], start_new_session=True, stdout=subprocess.PIPE, text=True)
left = int(p.stdout.readline())
assert wait_unreaped(p, 10)
kill_session(p)
end, fate = time.monotonic() + 5, "lived"
while time.monotonic() < end:  # this process is the namespace's init: the orphan is its child
    pid, status = os.waitpid(left, os.WNOHANG)
    if pid:
        fate = f"was killed by {signal.Signals(os.WTERMSIG(status)).name}" if os.WIFSIGNALED(status) else "exited"
        break
    time.sleep(0.02)
if fate == "lived":
    os.kill(left, signal.SIGKILL)
print(f"unwaited: its group's sleep {fate}")
"""
COMMON = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "common")


class FailureTest(MarkedTestCase):
    tmp_prefix = "dtrain_fail_"

    def summary(self, stderr):
        return stderr.strip().splitlines()[-1]

    def test_failure_stops_the_others_quickly(self):
        # rank 1 exits 3; rank 0 would sleep 60 s (its sleep carries the marker).
        script = f'if [ "$RANK" = 1 ]; then echo "rank one dies" >&2; exit 3; fi; exec {PY} -c "import time; time.sleep(60)" {self.marker}'
        t0 = time.monotonic()
        r = run(["--nproc_per_node", "2", "--standalone", "--grace_period", "2", "sh", "-c", script])
        took = time.monotonic() - t0
        self.assertEqual(r.returncode, 1, r.stderr)
        self.assertLess(took, 15)
        last = self.summary(r.stderr)
        self.assertRegex(last, r"^dtrain-run: rank 1 \(local rank 1, pid \d+\) failed first: it exited with code 3; "
                               r"no --log_dir: last lines shown above$")
        self.assertIn("rank one dies", r.stderr.split(last)[0])  # the tail, printed before the summary
        self.assertEqual(pids_with_marker(self.marker), [])

    def test_term_ignored_then_killed_after_grace(self):
        script = (f'if [ "$RANK" = 1 ]; then sleep 0.3; exit 5; fi; '
                  f'exec {PY} -c "import signal,time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)" {self.marker}')
        t0 = time.monotonic()
        r = run(["--nproc_per_node", "2", "--standalone", "--grace_period", "1", "sh", "-c", script])
        self.assertEqual(r.returncode, 1)
        self.assertLess(time.monotonic() - t0, 10)
        self.assertIn("rank 1 (local rank 1", self.summary(r.stderr))
        self.assertIn("exited with code 5", self.summary(r.stderr))
        self.assertEqual(pids_with_marker(self.marker), [])

    def test_death_by_signal_is_named(self):
        r = run(["--nproc_per_node", "2", "--standalone", "sh", "-c",
                 'if [ "$RANK" = 0 ]; then kill -SEGV $$; fi; sleep 30'])
        self.assertEqual(r.returncode, 1)
        self.assertRegex(self.summary(r.stderr), r"rank 0 \(local rank 0, pid \d+\) failed first: it was killed by SIGSEGV")

    def test_exec_failure_is_reported(self):
        prog = os.path.join(self.tmp, "bad_interp")
        with open(prog, "w") as f:
            f.write("#!/nonexistent/interpreter\n")
        os.chmod(prog, 0o755)
        r = run(["--nproc_per_node", "2", "--standalone", prog])
        self.assertEqual(r.returncode, 1)
        self.assertEqual(len(r.stderr.strip().splitlines()), 1, r.stderr)
        self.assertIn(prog, r.stderr)
        self.assertIn("No such file or directory", r.stderr)

    def worker_script(self):
        # Each worker: traps TERM/INT and writes a marker file; starts a grandchild that ignores
        # TERM/INT (only the process-group SIGKILL can end it); says it's ready.
        gc = f'(trap "" TERM INT HUP; exec {PY} -c "import time; time.sleep(300)" {self.marker}) &'
        return (f'trap "echo \\$RANK-got > {self.tmp}/sig.$RANK; exit 0" TERM INT HUP; {gc} '
                f'echo ready; while true; do sleep 0.1; done')

    def run_and_signal(self, signo):
        p = start(["--nproc_per_node", "2", "--standalone", "--grace_period", "1", "sh", "-c", self.worker_script()])
        try:
            self.assertTrue(wait_until(lambda: len(pids_with_marker(self.marker)) == 2, 10), "grandchildren not started")
            time.sleep(0.2)
            p.send_signal(signo)
            out, err = p.communicate(timeout=20)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
        self.assertEqual(p.returncode, 128 + signo, err)
        for rank in (0, 1):
            with open(os.path.join(self.tmp, f"sig.{rank}")) as f:
                self.assertEqual(f.read().strip(), f"{rank}-got")
        self.assertTrue(wait_until(lambda: pids_with_marker(self.marker) == [], 5), "grandchildren left behind")
        self.assertIn(signal.Signals(signo).name, err.strip().splitlines()[-1])

    def test_sigterm_forwarded_and_no_orphans(self):
        self.run_and_signal(signal.SIGTERM)

    def test_sigint_forwarded_and_no_orphans(self):
        self.run_and_signal(signal.SIGINT)

    def test_sighup_forwarded(self):
        self.run_and_signal(signal.SIGHUP)

    def test_grandchildren_killed_after_success(self):
        gc = f'(trap "" TERM INT; exec {PY} -c "import time; time.sleep(300)" {self.marker} >/dev/null 2>&1) &'
        r = run(["--nproc_per_node", "2", "--standalone", "sh", "-c", gc + " exit 0"])
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertTrue(wait_until(lambda: pids_with_marker(self.marker) == [], 5))

    def test_sigkill_of_launcher_kills_workers(self):
        p = start(["--nproc_per_node", "2", "--standalone", PY, "-c", "import time; time.sleep(300)", self.marker])
        try:
            self.assertTrue(wait_until(lambda: len(pids_with_marker(self.marker)) == 2, 10))
            p.kill()
            p.wait(timeout=10)
            self.assertTrue(wait_until(lambda: pids_with_marker(self.marker) == [], 5), "workers survived SIGKILL")
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
            p.stdout.close()
            p.stderr.close()

    def test_all_zero_exits_zero(self):
        r = run(["--nproc_per_node", "3", "--standalone", "true"])
        self.assertEqual((r.returncode, r.stdout, r.stderr), (0, "", ""))


class PidReuseTest(MarkedTestCase):
    """A process group is signalled by its number only while that number cannot be another's: the
    launcher's workers' groups, and the test harness's own (proc_util.kill_session)."""
    tmp_prefix = "dtrain_pid_reuse_"

    def in_pid_namespace(self, argv):
        if os.geteuid() != 0 or not shutil.which("unshare"):
            self.skipTest("needs root and unshare for a pid namespace whose next pid the test chooses")
        r = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", *argv], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, timeout=60)
        if r.returncode != 0 and "unshare" in r.stderr:
            self.skipTest(f"cannot create a pid namespace here: {r.stderr.strip()}")
        return r

    def test_the_pid_of_an_exited_worker_is_never_signalled_in_another_process(self):
        # Note [Held zombies]: the launcher holds a worker that exited as a zombie until its last
        # SIGKILL to the worker's group, so no other process can have that pid or lead that group.
        script = os.path.join(self.tmp, "reused_pid.sh")
        with open(script, "w") as f:
            f.write(REUSED_PID)
        r = self.in_pid_namespace(["sh", script, self.tmp, DTRAIN_RUN])
        with open(os.path.join(self.tmp, "run.err")) as f:
            err = f.read()
        lines = r.stdout.splitlines()
        self.assertEqual(len(lines), 2, r.stdout + r.stderr + err)
        self.assertRegex(lines[0], r"^launcher exit 1 rank1 pid \d+ other pid \d+$", err)
        self.assertEqual(lines[1], "other lived", r.stdout + err)

    def test_the_harness_never_kills_a_group_by_a_reused_pid(self):
        r = self.in_pid_namespace([PY, "-c", HARNESS_REUSE, COMMON])
        self.assertEqual(r.stdout.splitlines(), ["waited: pid taken again True, other lived True",
                                                 "unwaited: its group's sleep was killed by SIGKILL"],
                         r.stdout + r.stderr)


if __name__ == "__main__":
    unittest.main()
