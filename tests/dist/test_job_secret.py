"""The job secret (SECURITY.md): a one-node dtrain-run job makes one and gives it to its
workers alone, so a local process without it can neither read nor write a key, join as a node,
nor join as a rank, and the job goes on; the job's side says no more than how many it refused."""
import os
import shutil
import socket
import struct
import subprocess
import tempfile
import time
import unittest

from harness import DistTestCase, clean_env, free_port, hello, rank_env
from store_wire import SET, frame, read_frame

DTRAIN_RUN = os.environ.get("DTRAIN_RUN", "")


def closed(sock, within=3.0):
    """Whether the peer closed `sock` within `within` seconds (what it sent first is read and dropped)."""
    sock.settimeout(within)
    try:
        while sock.recv(4096):
            pass
        return True
    except (socket.timeout, ConnectionResetError):
        return False


class JobSecret(DistTestCase):
    def setUp(self):
        if not DTRAIN_RUN:
            raise unittest.SkipTest("dtrain-run is not built (set DTRAIN_RUN)")

    def test_a_process_without_the_secret_gets_nothing_and_the_job_goes_on(self):
        # The job stays up exactly as long as the intrusions take: its rank 0 waits in
        # init_process_group, on the launcher's store, for rank 1, whose process starts
        # hello_distributed only once the file `go` exists, which the test creates after the last
        # intrusion. So every intrusion meets a live job (one that a rank taking rank 1's place would
        # disrupt), and the job's one all_reduce runs after all of them.
        port = free_port()
        tmp = tempfile.mkdtemp(prefix="dtrain_job_secret_")
        self.addCleanup(shutil.rmtree, tmp, True)
        go = os.path.join(tmp, "go")
        rank1_waits = ('if [ "$LOCAL_RANK" = 1 ]; then while [ ! -e "$1" ]; do sleep 0.05; done; fi; '
                       'exec "$0" --timeout_s 60')
        job = self.spawn([DTRAIN_RUN, "--nnodes", "1", "--nproc_per_node", "2", "--master_port", port,
                          "sh", "-c", rank1_waits, hello(), go], clean_env())
        deadline = time.monotonic() + 20
        while True:  # the launcher's store is up
            try:
                sock = socket.create_connection(("127.0.0.1", port), timeout=2)
                break
            except OSError:
                if time.monotonic() > deadline:
                    self.fail(f"the job's store never came up:\n{job.finish(0)}")
                time.sleep(0.05)
        # A raw client: the greeting asks for the secret; a SET without the handshake is refused.
        hello_frame = read_frame(sock)
        self.assertIsNotNone(hello_frame)
        magic_len = struct.unpack("<I", hello_frame[1:5])[0]
        self.assertEqual(hello_frame[5:5 + magic_len], b"dtrain-store/1")
        auth = struct.unpack("<q", hello_frame[5 + magic_len + 4:5 + magic_len + 12])[0]
        self.assertEqual(auth, 1, "the job's store must require its secret")
        sock.sendall(frame(SET, "intruder", "x"))
        self.assertTrue(closed(sock), "a SET without the handshake must close the connection")
        sock.close()
        # As a node: another launcher without the secret.
        node = subprocess.run([DTRAIN_RUN, "--nnodes", "2", "--node_rank", "1", "--master_port", str(port),
                               "--rdzv_timeout", "5", "true"], env=clean_env(), capture_output=True,
                              text=True, timeout=30)
        self.assertNotEqual(node.returncode, 0)
        self.assertIn("requires the job's secret, which this process was not given", node.stderr)
        # As a rank: a worker started by hand against the launcher's store, as the rank 1 the job waits
        # for, without the secret.
        rank = subprocess.run([hello(), "--timeout_s", "5"],
                              env=rank_env(1, 2, port, DTRAIN_AGENT_STORE="1", LOCAL_RANK="1"),
                              capture_output=True, text=True, timeout=30)
        self.assertNotEqual(rank.returncode, 0)
        self.assertIn("requires the job's secret", rank.stderr)
        if job.ended():
            self.fail(f"the job ended during the intrusions:\n{job.finish(0)}")
        open(go, "w").close()
        res = job.finish(60)
        self.assertEqual(res.rc, 0, str(res))
        self.assertEqual(res.out.count("all_reduce check passed: sum of (rank+1) over 2 ranks = 3"), 2, str(res))
        self.assertIn("the rendezvous store refused 3 connection(s) that did not prove the job's secret", res.err)
        self.assertNotIn("error", res.err.lower(), str(res))

    def test_the_secret_reaches_the_workers_in_their_environment_only(self):
        probe = ('import os,sys; s=os.environ.get("DTRAIN_JOB_SECRET",""); '
                 'print("len", len(s), "in_argv", any(s in a for a in sys.argv) if s else None)')
        r = subprocess.run([DTRAIN_RUN, "--standalone", "--nproc_per_node", "2", "python3", "-c", probe],
                           env=clean_env(), capture_output=True, text=True, timeout=30)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(sorted(r.stdout.splitlines()), ["[rank 0] len 64 in_argv False",
                                                         "[rank 1] len 64 in_argv False"])


if __name__ == "__main__":
    unittest.main()
