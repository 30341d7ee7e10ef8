"""dtrain-run: [rank N] prefixes, whole lines, partial lines, long lines, log files, tee/redirects."""
import os
import re
import shutil
import tempfile
import unittest

from launcher_common import PY, require_launcher, run

LINE_RE = re.compile(r"^\[rank (\d+)\] (.*)$")


class OutputTest(unittest.TestCase):
    def setUp(self):
        require_launcher(self)
        self.tmp = tempfile.mkdtemp(prefix="dtrain_out_")

    def tearDown(self):
        shutil.rmtree(self.tmp, ignore_errors=True)

    def test_no_mid_line_interleaving(self):
        # 4 workers write 300 lines of 3000 characters each, concurrently, in small chunks so the
        # pipe reads split lines; every console line must be whole and carry the right prefix.
        script = ("import os,sys\n"
                  "r=int(os.environ['RANK']); c='abcd'[r]\n"
                  "for i in range(300):\n"
                  "    line=('%d:%04d:' % (r,i)) + c*3000 + '\\n'\n"
                  "    for k in range(0, len(line), 700):\n"
                  "        os.write(1, line[k:k+700].encode())\n"
                  "    os.write(2, ('err %d %d\\n' % (r,i)).encode())\n")
        r = run(["--nproc_per_node", "4", "--standalone", PY, "-c", script], timeout=60)
        self.assertEqual(r.returncode, 0, r.stderr[-2000:])
        seen = {rank: 0 for rank in range(4)}
        for line in r.stdout.splitlines():
            m = LINE_RE.match(line)
            self.assertIsNotNone(m, line[:120])
            rank = int(m.group(1))
            body = m.group(2)
            self.assertEqual(body, "%d:%04d:" % (rank, seen[rank]) + "abcd"[rank] * 3000, body[:60])
            seen[rank] += 1
        self.assertEqual(seen, {0: 300, 1: 300, 2: 300, 3: 300})
        err = [l for l in r.stderr.splitlines() if l.startswith("[rank")]
        self.assertEqual(len(err), 1200)
        for l in err:
            m = LINE_RE.match(l)
            self.assertTrue(m and m.group(2) == "err %s %s" % (m.group(1), m.group(2).split()[2]), l)

    def test_partial_line_at_eof(self):
        r = run(["--nproc_per_node", "2", "--standalone", "sh", "-c", 'printf "whole\\nno newline"'])
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(sorted(r.stdout.splitlines()),
                         ["[rank 0] no newline", "[rank 0] whole", "[rank 1] no newline", "[rank 1] whole"])

    def test_long_line_pieces_keep_prefix(self):
        n = 150000  # > 2 * 64 KiB
        script = f"import sys; sys.stdout.write('x'*{n} + '\\nend\\n')"
        r = run(["--nproc_per_node", "1", "--standalone", PY, "-c", script])
        self.assertEqual(r.returncode, 0, r.stderr)
        lines = r.stdout.splitlines()
        self.assertGreaterEqual(len(lines), 4)
        for l in lines:
            self.assertTrue(l.startswith("[rank 0] "), l[:40])
        self.assertEqual("".join(l[len("[rank 0] "):] for l in lines[:-1]), "x" * n)
        self.assertEqual(lines[-1], "[rank 0] end")

    def write_both(self):
        return ["sh", "-c", 'echo "out $RANK"; echo "err $RANK" >&2']

    def logs(self, rank, run_id="none"):
        d = os.path.join(self.tmp, run_id, "attempt_0", str(rank))
        with open(os.path.join(d, "stdout.log")) as f, open(os.path.join(d, "stderr.log")) as g:
            return f.read(), g.read()

    def test_log_dir_files_and_console(self):
        r = run(["--nproc_per_node", "2", "--standalone", "--log_dir", self.tmp, "--run_id", "j1"] + self.write_both())
        self.assertEqual(r.returncode, 0, r.stderr)
        for rank in (0, 1):
            self.assertEqual(self.logs(rank, "j1"), (f"out {rank}\n", f"err {rank}\n"))  # unprefixed
        self.assertIn("[rank 1] out 1", r.stdout)
        self.assertIn("[rank 1] err 1", r.stderr)

    def test_planted_log_links_are_not_followed(self):
        # A link where a log file goes is replaced, never written through; a link where one of the
        # folders below --log_dir goes is refused in one line.
        victim = os.path.join(self.tmp, "victim")
        with open(victim, "w") as f:
            f.write("precious")
        d = os.path.join(self.tmp, "logs", "j2", "attempt_0", "0")
        os.makedirs(d)
        os.symlink(victim, os.path.join(d, "stdout.log"))
        r = run(["--nproc_per_node", "1", "--standalone", "--log_dir", os.path.join(self.tmp, "logs"), "--run_id", "j2",
                 "--redirects", "3"] + self.write_both())
        self.assertEqual(r.returncode, 0, r.stderr)
        with open(victim) as f:
            self.assertEqual(f.read(), "precious")
        self.assertFalse(os.path.islink(os.path.join(d, "stdout.log")))
        with open(os.path.join(d, "stdout.log")) as f:
            self.assertEqual(f.read(), "out 0\n")
        elsewhere = os.path.join(self.tmp, "elsewhere")
        os.makedirs(elsewhere)
        os.symlink(elsewhere, os.path.join(self.tmp, "logs", "j3"))
        r = run(["--nproc_per_node", "1", "--standalone", "--log_dir", os.path.join(self.tmp, "logs"), "--run_id", "j3",
                 "--redirects", "3"] + self.write_both())
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("log directory '" + os.path.join(self.tmp, "logs", "j3") + "' is a symbolic link", r.stderr)
        self.assertEqual(os.listdir(elsewhere), [])

    def test_redirects_both_silences_console(self):
        r = run(["--nproc_per_node", "2", "--standalone", "--log_dir", self.tmp, "--redirects", "3"] + self.write_both())
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(r.stdout, "")
        self.assertNotIn("[rank", r.stderr)
        self.assertEqual(self.logs(0), ("out 0\n", "err 0\n"))

    def test_redirects_stdout_only(self):
        r = run(["--nproc_per_node", "1", "--standalone", "--log_dir", self.tmp, "--redirects", "1"] + self.write_both())
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(r.stdout, "")
        self.assertIn("[rank 0] err 0", r.stderr)
        self.assertEqual(self.logs(0), ("out 0\n", "err 0\n"))

    def test_tee_overrides_redirect(self):
        r = run(["--nproc_per_node", "1", "--standalone", "--log_dir", self.tmp, "--redirects", "3", "--tee", "2"]
                + self.write_both())
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(r.stdout, "")
        self.assertIn("[rank 0] err 0", r.stderr)
        self.assertEqual(self.logs(0), ("out 0\n", "err 0\n"))

    def test_failure_summary_points_at_log_files(self):
        r = run(["--nproc_per_node", "2", "--standalone", "--log_dir", self.tmp, "sh", "-c",
                 'echo boom >&2; exit $((RANK + 4))'])
        self.assertEqual(r.returncode, 1)
        last = r.stderr.strip().splitlines()[-1]
        self.assertRegex(last, r"^dtrain-run: rank \d \(local rank \d, pid \d+\) failed first: it exited with code [45]")
        self.assertIn(os.path.join(self.tmp, "none", "attempt_0"), last)
        self.assertIn("stderr.log", last)


if __name__ == "__main__":
    unittest.main()
