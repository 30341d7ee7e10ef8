"""dtrain-run: bad input gives ONE clear line and exit 2, fast; port in use; bind address."""
import os
import socket
import tempfile
import time
import unittest

from launcher_common import PY, clean_env, free_port, listeners, require_launcher, run, start, wait_until


class UsageTest(unittest.TestCase):
    def setUp(self):
        require_launcher(self)

    def bad(self, args, *fragments, code=2, env=None):
        t0 = time.monotonic()
        r = run(args, timeout=10, env=env)
        took = time.monotonic() - t0
        self.assertEqual(r.returncode, code, f"{args}: {r.stderr}")
        lines = r.stderr.strip().splitlines()
        self.assertEqual(len(lines), 1, f"{args}: {r.stderr!r}")
        self.assertTrue(lines[0].startswith("dtrain-run: "), lines[0])
        for frag in fragments:
            self.assertIn(frag, lines[0])
        self.assertEqual(r.stdout, "")
        self.assertLess(took, 2.0)
        return lines[0]

    def test_bad_values(self):
        self.assertEqual(self.bad(["--nproc_per_node", "0", "true"]),
                         "dtrain-run: --nproc_per_node must be a positive integer, auto, cpu or gpu, got '0'")
        self.bad(["--nproc_per_node", "two", "true"], "'two'")
        self.bad(["--nproc_per_node", "-1", "true"], "'-1'")
        self.bad(["--nnodes", "0", "true"], "--nnodes", "'0'")
        self.bad(["--nnodes", "2", "--node_rank", "2", "true"], "--node_rank 2", "--nnodes 2")
        self.bad(["--node_rank", "-1", "true"], "--node_rank", "'-1'")
        self.bad(["--master_port", "70000", "true"], "--master_port", "'70000'")
        self.bad(["--master_port", "http", "true"], "'http'")
        self.bad(["--max_restarts", "-1", "true"], "--max_restarts", "'-1'")
        self.bad(["--ft", "--nnodes", "2:4", "true"], "--ft needs a fixed node count", "--nnodes is 2:4 (elastic)")
        self.bad(["--ft", "--nnodes", "2", "--rdzv_backend", "c10d", "--rdzv_endpoint", "127.0.0.1:1", "true"],
                 "--ft on several nodes needs fixed node ranks", "drop --rdzv_backend c10d")
        self.bad(["--monitor_interval", "0", "true"], "--monitor_interval", "'0'")
        self.bad(["--rdzv_timeout", "x", "true"], "--rdzv_timeout", "'x'")
        self.assertEqual(self.bad(["--grace_period", "-0.5", "true"]),
                         "dtrain-run: --grace_period must be a number of seconds >= 0 (inf: forever), got '-0.5'")
        self.bad(["--rdzv_timeout", "nan", "true"], "--rdzv_timeout", "'nan'")
        self.assertEqual(self.bad(["--node-rank", "1.5", "true"]),  # an alias: the error names the flag
                         "dtrain-run: --node_rank must be an integer >= 0, got '1.5'")
        self.bad(["--monitor_interval", "3601", "true"], "--monitor_interval", "'3601'")
        self.bad(["-t", "7", "--log_dir", "/tmp", "true"], "--tee", "'7'")
        self.bad(["--redirects", "4", "--log_dir", "/tmp", "true"], "--redirects", "'4'")
        # The per-local-rank form (torchrun's Std.from_str): each item LOCAL_RANK:0..3, each rank once.
        self.assertEqual(self.bad(["--tee", "0:4", "true"]),
                         "dtrain-run: --tee must be 0 (none), 1 (stdout), 2 (stderr), 3 (both), or LOCAL_RANK:MASK,... "
                         "for some local ranks (e.g. --tee 0:3,1:2), got '0:4'")
        for bad in ("0:1,", "a:1", "0:1,1", ":2", "0:1:2"):
            self.bad(["--redirects", bad, "true"], "--redirects must be", f"'{bad}'")
        self.assertEqual(self.bad(["--redirects", "0:1,0:2", "true"]),
                         "dtrain-run: --redirects names local rank 0 twice in '0:1,0:2': give each local rank once")
        self.bad(["--standalone", "--nnodes", "2", "true"], "--standalone", "--nnodes")
        for addr in ("0.0.0.0", "::", "[::]", "0"):
            self.bad(["--master_addr", addr, "true"], f"--master_addr {addr} is the wildcard address", "127.0.0.1")
        # Every form that names the master: the pod's environment, torchrun's PET_ variables, an srun step.
        for addr in ("0.0.0.0", "::"):
            pod = clean_env(WORLD_SIZE="2", RANK="0", MASTER_ADDR=addr, MASTER_PORT=str(free_port()))
            self.bad(["true"], f"MASTER_ADDR (a Kubeflow PyTorchJob pod's) {addr} is the wildcard address",
                     "127.0.0.1", env=pod)
            self.bad(["true"], f"--master_addr {addr} is the wildcard address", f"PET_MASTER_ADDR={addr}",
                     env=clean_env(PET_NNODES="2", PET_MASTER_ADDR=addr))
            step = clean_env(SLURM_JOB_ID="4242", SLURM_STEP_ID="0", SLURM_STEP_NUM_TASKS="2", SLURM_PROCID="0",
                             SLURM_LOCALID="0", SLURM_NODEID="0", SLURM_STEP_TASKS_PER_NODE="2", SLURM_NTASKS="2",
                             SLURM_STEP_NODELIST="localhost", MASTER_ADDR=addr, MASTER_PORT=str(free_port()))
            self.bad(["true"], f"this srun step's MASTER_ADDR {addr} is the wildcard address", env=step)

    def test_torchrun_flags_dtrain_run_does_not_take(self):
        # -m: dtrain-run starts programs; the line says why and what to write instead.
        for m in ("-m", "--module"):
            self.assertEqual(self.bad([m, "pkg.train"]),
                             f"dtrain-run: {m} is torchrun's and dtrain-run does not take it: it runs a Python module "
                             "(python -m) and dtrain-run starts programs, not modules: give the program instead, "
                             "e.g. dtrain-run [OPTIONS] python3 -m MODULE ARGS")
        self.bad(["true"], "--module", env=clean_env(PET_MODULE="1"))
        # Any other torchrun flag, in either spelling, named with what to use instead.
        self.bad(["--start-method", "spawn", "true"], "--start-method is torchrun's", "drop it")
        self.bad(["--shutdown_timeout", "5", "true"], "--shutdown_timeout is torchrun's", "--grace_period")
        self.bad(["--log-line-prefix-template", "x", "true"], "--log-line-prefix-template", "[rank N]")

    def test_bad_torchrun_values(self):
        self.bad(["--nproc_per_node", "tpu", "true"], "--nproc_per_node", "auto, cpu or gpu", "'tpu'")
        self.bad(["--nproc_per_node", "gpu", "true"], "--nproc_per_node gpu", "give a number, cpu or auto",
                 env=clean_env(CUDA_VISIBLE_DEVICES=""))
        self.bad(["--rdzv_backend", "etcd", "true"], "--rdzv_backend must be static or c10d, got 'etcd'")
        self.bad(["--rdzv_conf", "join_timeout=soon", "true"], "--rdzv_conf join_timeout=soon",
                 "a number of seconds > 0")
        self.bad(["--rdzv_conf", "is_host=maybe", "true"], "--rdzv_conf is_host=maybe", "1")
        self.bad(["--rdzv_conf", "keep_alive=5", "true"], "'keep_alive'", "join_timeout")
        self.bad(["--rdzv_conf", "join_timeout=5", "--rdzv_timeout", "5", "true"], "give one of them")
        self.bad(["--rdzv_endpoint", "host:http", "true"], "--rdzv_endpoint 'host:http'", "0..65535")
        self.bad(["--rdzv_backend", "c10d", "--rdzv_endpoint", "node0:0", "--nnodes", "2", "true"],
                 "port 0", "one node only")
        self.bad(["--local_ranks_filter", "0,x", "true"], "--local_ranks_filter", "'0,x'")
        self.bad(["--rdzv_backend", "c10d", "--rdzv_endpoint", "0.0.0.0:29400", "--nnodes", "2", "true"],
                 "--rdzv_endpoint 0.0.0.0:29400 is the wildcard address")
        # A PET_ variable's bad value is the flag's error, saying where it came from.
        self.assertEqual(self.bad(["true"], env=clean_env(PET_NNODES="two")),
                         "dtrain-run: --nnodes must be a positive integer or MIN:MAX, got 'two' (from the environment: "
                         "PET_NNODES=two)")
        self.bad(["true"], "PET_STANDALONE='yes'", "integer", env=clean_env(PET_STANDALONE="yes"))

    def test_torchrun_spellings_are_accepted(self):
        r = run(["--standalone", "--no-python", "--no_python", "--nproc-per-node", "1", "--rdzv-backend", "static", "--role", "",
                 "--local-addr", "me", "--local-ranks-filter", "0", "--rdzv-conf", "close_timeout=5,read_timeout=9",
                 "sh", "-c", 'echo "role=[$ROLE_NAME]"'])
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(r.stdout, "[rank 0] role=[]\n")

    def test_unknown_flag_before_program(self):
        self.bad(["--nproc_per_node", "2", "--bogus_flag", "true"], "'--bogus_flag'")

    def test_missing_value(self):
        self.bad(["--nproc_per_node"], "--nproc_per_node")

    def test_no_program(self):
        self.bad([], "no program")
        self.bad(["--nproc_per_node", "2"], "no program")
        self.bad(["--nproc_per_node", "2", "--"], "no program")

    def test_program_not_found_or_not_executable(self):
        self.bad(["no-such-program-dtrain"], "'no-such-program-dtrain'", "PATH")
        self.bad(["./no/such/file"], "'./no/such/file'")
        with tempfile.NamedTemporaryFile(suffix=".txt") as f:
            os.chmod(f.name, 0o644)
            self.bad([f.name], f"'{f.name}'", "not an executable")

    def test_help(self):
        r = run(["--help"], timeout=10)
        self.assertEqual(r.returncode, 0)
        self.assertIn("--nproc_per_node", r.stdout)

    def test_version(self):
        r = run(["--version"], timeout=10)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertRegex(r.stdout, r"^dtrain-run \d+\.\d+\.\d+\n$")

    def test_loads_no_libtorch(self):
        # README: "The launcher does not link LibTorch, so it starts in milliseconds" (a whole launch
        # of two `true` workers takes about 10 ms here; loading LibTorch alone takes hundreds).
        p = start(["--standalone", "--nproc_per_node", "1", PY, "-c", "import time; time.sleep(5)"])
        try:
            maps = ""

            def read_maps():
                nonlocal maps
                with open(f"/proc/{p.pid}/maps") as f:
                    maps = f.read()
                return "dtrain-run" in maps

            self.assertTrue(wait_until(read_maps, timeout=5), "could not read the launcher's memory map")
            libs = sorted({line.split()[-1] for line in maps.splitlines() if ".so" in line})
            self.assertEqual([lib for lib in libs if "torch" in lib or "libc10" in lib], [], libs)
        finally:
            p.terminate()  # forwarded to the worker, so nothing outlives the test
            p.communicate(timeout=10)

    def test_max_restarts_accepted(self):
        r = run(["--max_restarts", "3", "--standalone", "true"])
        self.assertEqual(r.returncode, 0, r.stderr)

    def test_port_in_use(self):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            s.listen(1)
            port = s.getsockname()[1]
            self.bad(["--master_port", port, "--nproc_per_node", "1", "true"],
                     f"port {port} on 127.0.0.1 is already in use", "--master_port", "--standalone", code=1)

    def test_quick_rerun_on_same_port(self):
        port = free_port()
        for _ in range(2):  # the second run must not trip over TIME_WAIT
            r = run(["--master_port", port, "--nproc_per_node", "2", PY, "-c",
                     "import os,socket; socket.create_connection((os.environ['MASTER_ADDR'], int(os.environ['MASTER_PORT']))).close()"])
            self.assertEqual(r.returncode, 0, r.stderr)

    def test_store_listens_only_on_master_addr(self):
        port = free_port()
        p = start(["--master_port", port, "--nproc_per_node", "1", "sleep", "3"])
        try:
            self.assertTrue(wait_until(lambda: listeners(port) != [], 5), "no listener")
            self.assertEqual(listeners(port), ["0100007F"])  # 127.0.0.1, never 0.0.0.0
        finally:
            p.kill()
            p.communicate()


if __name__ == "__main__":
    unittest.main()
