"""dtrain-run: [rank N] prefixes, whole lines, partial lines, long lines, log files, tee/redirects."""
import os
import re
import shutil
import tempfile
import unittest

from launcher_common import PY, clean_env, require_launcher, run, run_folder

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
        d = os.path.join(run_folder(self.tmp, run_id), "attempt_0", str(rank))
        with open(os.path.join(d, "stdout.log")) as f, open(os.path.join(d, "stderr.log")) as g:
            return f.read(), g.read()

    def test_log_dir_files_and_console(self):
        r = run(["--nproc_per_node", "2", "--standalone", "--log_dir", self.tmp, "--run_id", "j1"] + self.write_both())
        self.assertEqual(r.returncode, 0, r.stderr)
        for rank in (0, 1):
            self.assertEqual(self.logs(rank, "j1"), (f"out {rank}\n", f"err {rank}\n"))  # unprefixed
        self.assertIn("[rank 1] out 1", r.stdout)
        self.assertIn("[rank 1] err 1", r.stderr)

    def test_each_run_writes_to_a_fresh_folder_of_its_own(self):
        # torchrun's layout, <log_dir>/<run_id>_<random>/attempt_<k>/<local_rank>/: a link planted
        # where an earlier layout put the run's folder is never written through, and two runs with one
        # --run_id never mix their files.
        logs = os.path.join(self.tmp, "logs")
        elsewhere = os.path.join(self.tmp, "elsewhere")
        os.makedirs(logs)
        os.makedirs(elsewhere)
        os.symlink(elsewhere, os.path.join(logs, "j2"))
        for _ in range(2):
            r = run(["--nproc_per_node", "1", "--standalone", "--log_dir", logs, "--run_id", "j2", "--redirects", "3"]
                    + self.write_both())
            self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(os.listdir(elsewhere), [])
        runs = sorted(d for d in os.listdir(logs) if d.startswith("j2_"))
        self.assertEqual(len(runs), 2, os.listdir(logs))
        for d in runs:
            folder = os.path.join(logs, d)
            self.assertFalse(os.path.islink(folder))
            self.assertEqual(os.stat(folder).st_mode & 0o777, 0o700)
            with open(os.path.join(folder, "attempt_0", "0", "stdout.log")) as f:
                self.assertEqual(f.read(), "out 0\n")

    def test_tee_without_log_dir_writes_to_a_temporary_folder(self):
        # As torchrun: --tee needs no --log_dir; the files go to a new folder under TMPDIR, named once.
        r = run(["--nproc_per_node", "2", "--tee", "3", "--local_ranks_filter", "1"] + self.write_both(),
                env=clean_env(TMPDIR=self.tmp))
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(r.stdout, "[rank 1] out 1\n")  # --local_ranks_filter: the console shows local rank 1 only
        said = [l for l in r.stderr.splitlines() if "no --log_dir was given" in l]
        self.assertEqual(len(said), 1, r.stderr)
        top = [d for d in os.listdir(self.tmp) if d.startswith("dtrain-run_")]
        self.assertEqual(len(top), 1, os.listdir(self.tmp))
        self.assertIn(os.path.join(self.tmp, top[0]), said[0])
        for rank in (0, 1):
            d = os.path.join(run_folder(os.path.join(self.tmp, top[0])), "attempt_0", str(rank))
            with open(os.path.join(d, "stdout.log")) as f:
                self.assertEqual(f.read(), f"out {rank}\n")

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

    def test_redirects_and_tee_per_local_rank(self):
        # torchrun's Std.from_str/to_map: "LOCAL:MASK,..." sets the named local ranks only, the others get
        # none. Local rank 0 is redirected whole, local rank 1 its stdout only and tees its stderr (a
        # no-op beside nothing redirected), local rank 2 is not named: its console keeps both.
        r = run(["--nproc_per_node", "3", "--standalone", "--log_dir", self.tmp, "--redirects", "0:3,1:1",
                 "--tee", "1:2"] + self.write_both())
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(sorted(LINE_RE.match(l).group(0) for l in r.stdout.splitlines()), ["[rank 2] out 2"])
        self.assertEqual(sorted(l for l in r.stderr.splitlines() if l.startswith("[rank")),
                         ["[rank 1] err 1", "[rank 2] err 2"])
        for rank in (0, 1, 2):  # the log files keep every rank's streams
            self.assertEqual(self.logs(rank), (f"out {rank}\n", f"err {rank}\n"))

    def test_tee_per_local_rank_over_redirects(self):
        # --redirects 3 silences every local rank; --tee 1:1 brings back local rank 1's stdout only.
        r = run(["--nproc_per_node", "2", "--standalone", "--log_dir", self.tmp, "--redirects", "3", "--tee", "1:1"]
                + self.write_both())
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(r.stdout, "[rank 1] out 1\n")
        self.assertNotIn("[rank", r.stderr)

    def test_failure_summary_points_at_log_files(self):
        r = run(["--nproc_per_node", "2", "--standalone", "--log_dir", self.tmp, "sh", "-c",
                 'echo boom >&2; exit $((RANK + 4))'])
        self.assertEqual(r.returncode, 1)
        last = r.stderr.strip().splitlines()[-1]
        self.assertRegex(last, r"^dtrain-run: rank \d \(local rank \d, pid \d+\) failed first: it exited with code [45]")
        self.assertIn(os.path.join(run_folder(self.tmp), "attempt_0"), last)
        self.assertIn("stderr.log", last)


if __name__ == "__main__":
    unittest.main()
