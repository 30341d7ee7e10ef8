"""dtrain-run: each worker's environment and command line (torchrun's contract)."""
import json
import os
import tempfile
import unittest

from launcher_common import PY, clean_env, free_port, require_launcher, run

DUMP_ENV = ("import json,os,sys; print(json.dumps({'argv': sys.argv[1:], 'env': {k: os.environ.get(k) for k in "
            "['RANK','LOCAL_RANK','WORLD_SIZE','LOCAL_WORLD_SIZE','GROUP_RANK','NODE_RANK','ROLE_RANK',"
            "'ROLE_WORLD_SIZE','MASTER_ADDR','MASTER_PORT','TORCHELASTIC_RUN_ID','DTRAIN_RUN_ID',"
            "'DTRAIN_RESTART_COUNT','TORCHELASTIC_RESTART_COUNT','DTRAIN_MAX_RESTARTS','DTRAIN_AGENT_STORE',"
            "'OMP_NUM_THREADS']}}))")


def dumps(result):
    """rank -> {'argv':..., 'env':...} from the workers' prefixed stdout."""
    out = {}
    for line in result.stdout.splitlines():
        prefix, _, payload = line.partition("] ")
        out[int(prefix[len("[rank "):])] = json.loads(payload)
    return out


class EnvTest(unittest.TestCase):
    def setUp(self):
        require_launcher(self)

    def test_env_per_worker(self):
        r = run(["--nproc_per_node", "3", "--standalone", "--max_restarts", "2", "--run_id", "job7",
                 PY, "-c", DUMP_ENV])
        self.assertEqual(r.returncode, 0, r.stderr)
        d = dumps(r)
        self.assertEqual(sorted(d), [0, 1, 2])
        ports = set()
        for rank, info in d.items():
            e = info["env"]
            self.assertEqual(e["RANK"], str(rank))
            self.assertEqual(e["LOCAL_RANK"], str(rank))
            self.assertEqual(e["ROLE_RANK"], str(rank))
            self.assertEqual(e["WORLD_SIZE"], "3")
            self.assertEqual(e["LOCAL_WORLD_SIZE"], "3")
            self.assertEqual(e["ROLE_WORLD_SIZE"], "3")
            self.assertEqual(e["GROUP_RANK"], "0")
            self.assertEqual(e["NODE_RANK"], "0")
            self.assertEqual(e["MASTER_ADDR"], "127.0.0.1")
            self.assertEqual(e["TORCHELASTIC_RUN_ID"], "job7")
            self.assertEqual(e["DTRAIN_RUN_ID"], "job7")
            self.assertEqual(e["DTRAIN_RESTART_COUNT"], "0")
            self.assertEqual(e["TORCHELASTIC_RESTART_COUNT"], "0")
            self.assertEqual(e["DTRAIN_MAX_RESTARTS"], "2")
            self.assertEqual(e["DTRAIN_AGENT_STORE"], "1")
            ports.add(e["MASTER_PORT"])
        self.assertEqual(len(ports), 1)
        self.assertNotEqual(ports.pop(), "29500")  # --standalone picked a free port

    def test_omp_num_threads_default_and_respected(self):
        r = run(["--nproc_per_node", "2", "--standalone", PY, "-c", DUMP_ENV])
        self.assertEqual(r.returncode, 0, r.stderr)
        want = str(max(1, os.sysconf("SC_NPROCESSORS_ONLN") // 2))
        for info in dumps(r).values():
            self.assertEqual(info["env"]["OMP_NUM_THREADS"], want)
        r = run(["--nproc_per_node", "2", "--standalone", PY, "-c", DUMP_ENV], env=clean_env(OMP_NUM_THREADS=7))
        for info in dumps(r).values():
            self.assertEqual(info["env"]["OMP_NUM_THREADS"], "7")

    def test_auto_nproc(self):
        r = run(["--nproc_per_node", "auto", "--standalone", PY, "-c", DUMP_ENV])
        self.assertEqual(r.returncode, 0, r.stderr)
        n = os.sysconf("SC_NPROCESSORS_ONLN")
        d = dumps(r)
        self.assertEqual(sorted(d), list(range(n)))
        self.assertEqual(d[0]["env"]["WORLD_SIZE"], str(n))
        self.assertEqual(d[0]["env"]["OMP_NUM_THREADS"], "1")

    def test_program_args_pass_through(self):
        r = run(["--nproc_per_node", "2", "--standalone", PY, "-c", DUMP_ENV, "--lr", "0.1", "--nproc_per_node", "7"])
        self.assertEqual(r.returncode, 0, r.stderr)
        for info in dumps(r).values():
            self.assertEqual(info["argv"], ["--lr", "0.1", "--nproc_per_node", "7"])
            self.assertEqual(info["env"]["WORLD_SIZE"], "2")

    def test_double_dash_and_aliases(self):
        port = free_port()
        r = run(["--nproc-per-node=2", "--master-port", str(port), "--", PY, "-c", DUMP_ENV, "--x"])
        self.assertEqual(r.returncode, 0, r.stderr)
        d = dumps(r)
        self.assertEqual(sorted(d), [0, 1])
        self.assertEqual(d[1]["argv"], ["--x"])
        self.assertEqual(d[1]["env"]["MASTER_PORT"], str(port))

    def test_use_local_rank_arg(self):
        with tempfile.TemporaryDirectory() as d:
            prog = os.path.join(d, "echo_args")
            with open(prog, "w") as f:
                f.write('#!/bin/sh\necho "$@"\n')
            os.chmod(prog, 0o755)
            r = run(["--nproc_per_node", "2", "--standalone", "--use_local_rank_arg", prog, "--lr", "1"])
            self.assertEqual(r.returncode, 0, r.stderr)
            self.assertEqual(sorted(r.stdout.splitlines()),
                             ["[rank 0] --local_rank=0 --lr 1", "[rank 1] --local_rank=1 --lr 1"])
            r = run(["--nproc_per_node", "1", "--standalone", prog, "--lr", "1"])  # without the flag
            self.assertEqual(r.stdout.splitlines(), ["[rank 0] --lr 1"])

    def test_program_found_in_path(self):
        with tempfile.TemporaryDirectory() as d:
            with open(os.path.join(d, "my-dtrain-prog"), "w") as f:
                f.write('#!/bin/sh\necho "found $RANK"\n')
            os.chmod(os.path.join(d, "my-dtrain-prog"), 0o755)
            env = clean_env(PATH=d + ":" + os.environ.get("PATH", "/usr/bin:/bin"))
            r = run(["--nproc_per_node", "1", "--standalone", "my-dtrain-prog"], env=env)
            self.assertEqual(r.returncode, 0, r.stderr)
            self.assertEqual(r.stdout, "[rank 0] found 0\n")


if __name__ == "__main__":
    unittest.main()
