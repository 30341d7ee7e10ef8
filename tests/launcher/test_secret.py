"""dtrain-run's job secret (tools/dtrain-run/secret.h): --rdzv_conf secret_file=PATH shared by the
launchers of several nodes, refused when others could read it; a node with another secret is turned
away in one line; a job of several nodes given none runs open and says so."""
import os
import shutil
import subprocess
import time
import unittest

from launcher_common import DTRAIN_RUN, PY, MarkedTestCase, clean_env, finish, free_port, run, start

SHOW = 'echo "secret=${DTRAIN_JOB_SECRET:-none}"'


def node_args(port, node_rank, extra=()):
    return ["--nnodes", 2, "--node_rank", node_rank, "--nproc_per_node", 1, "--master_addr", "127.0.0.1",
            "--master_port", port, "--rdzv_timeout", "10", *extra]


class SecretTest(MarkedTestCase):
    tmp_prefix = "dtrain_secret_"

    def secret_file(self, name, text, mode=0o600):
        path = os.path.join(self.tmp, name)
        with open(path, "w") as f:
            f.write(text + "\n")
        os.chmod(path, mode)
        return path

    def test_two_nodes_share_the_secret_file(self):
        path = self.secret_file("job", "a" * 40)
        port = free_port()
        conf = ["--rdzv_conf", f"secret_file={path}"]
        n1 = start(node_args(port, 1, conf) + ["sh", "-c", SHOW])
        time.sleep(0.2)
        n0 = start(node_args(port, 0, conf) + ["sh", "-c", SHOW])
        (rc0, out0, err0), (rc1, out1, err1) = finish(n0, n1)
        self.assertEqual((rc0, rc1), (0, 0), err0 + err1)
        self.assertEqual(out0.strip() + out1.strip(), f"[rank 0] secret={'a' * 40}[rank 1] secret={'a' * 40}")
        self.assertNotIn("no job secret", err0 + err1)

    def test_a_node_with_another_secret_is_turned_away(self):
        port = free_port()
        n0 = start(node_args(port, 0, ["--rdzv_conf", "secret_file=" + self.secret_file("a", "a" * 40)]) + ["true"])
        time.sleep(0.3)
        rc1, out1, err1 = finish(start(node_args(port, 1, ["--rdzv_conf",
                                                           "secret_file=" + self.secret_file("b", "b" * 40)])
                                       + ["true"]))[0]
        n0.kill()
        finish(n0)
        self.assertNotEqual(rc1, 0)
        lines = [l for l in err1.splitlines() if "secret" in l]
        self.assertEqual(len(lines), 1, err1)
        self.assertIn("its job secret is not the job's", lines[0])

    def test_a_secret_file_others_can_read_is_refused(self):
        path = self.secret_file("open", "c" * 40, mode=0o644)
        r = run(["--rdzv_conf", f"secret_file={path}", "true"])
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertEqual(r.stderr.strip(), f"dtrain-run: --rdzv_conf secret_file={path} has mode 0644: other users "
                                           f"can read or change it; chmod 600 {path}")

    def test_a_short_secret_and_an_unknown_key_are_usage_errors(self):
        r = run(["--rdzv_conf", "secret_file=" + self.secret_file("short", "tiny"), "true"])
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("holds 4 bytes: a job secret has at least 32", r.stderr)
        r = run(["--rdzv_conf", "join_timout=5", "true"])
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("--rdzv_conf key 'join_timout' is not one dtrain-run takes", r.stderr)
        r = run(["true"], env=clean_env(DTRAIN_JOB_SECRET="short"))
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("DTRAIN_JOB_SECRET holds 5 bytes", r.stderr)

    def test_the_environment_gives_the_secret_too(self):
        r = run(["--nproc_per_node", 1, "sh", "-c", SHOW], env=clean_env(DTRAIN_JOB_SECRET="e" * 33))
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(r.stdout.strip(), f"[rank 0] secret={'e' * 33}")

    def test_several_nodes_without_a_secret_run_open_and_say_so(self):
        port = free_port()
        n1 = start(node_args(port, 1) + ["sh", "-c", SHOW])
        time.sleep(0.2)
        n0 = start(node_args(port, 0) + ["sh", "-c", SHOW])
        (rc0, out0, err0), (rc1, out1, err1) = finish(n0, n1)
        self.assertEqual((rc0, rc1), (0, 0), err0 + err1)
        self.assertIn("secret=none", out0)
        for err in (err0, err1):
            warned = [l for l in err.splitlines() if "no job secret was given" in l]
            self.assertEqual(len(warned), 1, err)
            self.assertIn(f"the rendezvous store at 127.0.0.1:{port} is open to anyone who can reach that port",
                          warned[0])


# Inside a mount namespace whose /etc/hosts gives "dualhost" two addresses: hold the port on the
# address clients try first, then start a one-node job on dualhost at that port.
SQUAT = r"""
import socket, subprocess, sys
addrs = [a for a in socket.getaddrinfo("dualhost", 0, type=socket.SOCK_STREAM)]
if len({a[4][0] for a in addrs}) < 2:
    print("dualhost has one address here"); sys.exit(77)
first = addrs[0]
squatter = socket.socket(first[0], socket.SOCK_STREAM)
squatter.bind((first[4][0], 0))
squatter.listen(4)
port = squatter.getsockname()[1]
r = subprocess.run([sys.argv[1], "--master_addr", "dualhost", "--master_port", str(port), "true"],
                   capture_output=True, text=True, timeout=30)
print(f"first={first[4][0]} rc={r.returncode}")
print(r.stderr.strip())
"""


class StoreAddressTest(MarkedTestCase):
    tmp_prefix = "dtrain_addr_"

    def test_a_held_port_on_the_first_address_is_an_error_not_a_fall_back(self):
        # The store bound the first address that bound: with the port held on ::1, `localhost` went on
        # to 127.0.0.1, while clients, trying ::1 first, reached the holder.
        if os.geteuid() != 0 or not shutil.which("unshare"):
            self.skipTest("needs root and unshare for a mount namespace with its own /etc/hosts")
        hosts = os.path.join(self.tmp, "hosts")
        with open(hosts, "w") as f:
            f.write("::1 dualhost\n127.0.0.1 dualhost\n")
        script = os.path.join(self.tmp, "squat.py")
        with open(script, "w") as f:
            f.write(SQUAT)
        r = subprocess.run(["unshare", "--mount", "sh", "-c", f"mount --bind {hosts} /etc/hosts && "
                            f"exec {PY} {script} {DTRAIN_RUN}"], capture_output=True, text=True, timeout=60)
        if r.returncode == 77:
            self.skipTest(r.stdout.strip())
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        first, rc = r.stdout.splitlines()[0].split()
        self.assertNotEqual(rc, "rc=0", r.stdout)
        self.assertIn("is already in use", r.stdout)


if __name__ == "__main__":
    unittest.main()
