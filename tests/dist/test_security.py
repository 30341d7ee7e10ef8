"""Nothing a job opens listens beyond the master address: the store that rank 0 hosts listens on
MASTER_ADDR only, never 0.0.0.0, and Gloo's sockets are bound to the address of the interface that
routes to the master (SECURITY.md), or to GLOO_SOCKET_IFNAME's interface when it is set.

Sockets are read from /proc/net/tcp{,6} and matched to a process through /proc/<pid>/fd inodes."""
import os
import socket
import subprocess
import time
import unittest

from harness import DistTestCase, clean_env, free_port, hello, launcher, rank_env
from proc_util import non_loopback_ipv4

LISTEN = "0A"
LOOPBACK = "0100007F"  # 127.0.0.1 as /proc/net/tcp writes it (little-endian hex)

# A torchrun-style agent store that also plays a rank 1 which passes dtrain's rendezvous check and
# then never joins Gloo: rank 0 then holds its Gloo listening socket open until its timeout.
FAKE_RANK1 = r"""
import datetime, sys
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), 2, True,
                      timeout=datetime.timedelta(seconds=60), wait_for_workers=False)
store.add("dtrain/a0/claim/1", 1)
store.set("dtrain/a0/rank/1", "2\nnot-this-host/127.0.0.1")
print("ready", flush=True)
sys.stdin.read()
"""


def hex_ipv4(addr):
    """addr as /proc/net/tcp writes it: "127.0.0.1" -> "0100007F"."""
    return socket.inet_aton(addr)[::-1].hex().upper()


def tcp_sockets():
    """[(family, local_ip_hex, port, state, inode, remote_port)] for every TCP socket in this network
    namespace."""
    out = []
    for family in ("tcp", "tcp6"):
        try:
            with open(f"/proc/net/{family}") as f:
                lines = f.read().splitlines()[1:]
        except FileNotFoundError:
            continue
        for line in lines:
            cols = line.split()
            ip, port = cols[1].split(":")
            out.append((family, ip, int(port, 16), cols[3], int(cols[9]), int(cols[2].split(":")[1], 16)))
    return out


def socket_inodes(pid):
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                inodes.add(int(link[8:-1]))
    except OSError:
        pass
    return inodes


def describe(sock):
    family, ip, port, state, inode, remote_port = sock
    return f"{family} {ip}:{port} (to port {remote_port}) state {state} inode {inode}"


class Security(DistTestCase):
    def setUp(self):
        if not os.path.exists("/proc/net/tcp"):
            self.skipTest("no /proc/net/tcp on this system")

    def sockets_of(self, pids):
        inodes = set()
        for pid in pids:
            inodes |= socket_inodes(pid)
        return [s for s in tcp_sockets() if s[4] in inodes and s[4] != 0]

    def assertBound(self, socks, addr, what):
        bad = [describe(s) for s in socks if not (s[0] == "tcp" and s[1] == hex_ipv4(addr))]
        self.assertEqual(bad, [], f"{what} not bound to {addr}")

    def assertLoopback(self, socks, what):
        self.assertBound(socks, "127.0.0.1", what)

    def watch_job(self, addr, **extra):
        """Runs a 2-rank job with MASTER_ADDR=addr until both ranks hold their group; returns the
        store's port and every TCP socket the ranks had meanwhile: (port, [socket])."""
        port = free_port()
        procs = [self.spawn([hello(), "--timeout_s", 30, "--hold_s", 4], rank_env(r, 2, port, addr=addr, **extra))
                 for r in range(2)]
        pids = [p.pid for p in procs]
        seen = {}  # inode -> socket, every socket of the ranks seen while the job ran
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and any(not p.ended() for p in procs):
            for s in self.sockets_of(pids):
                seen[s[4]] = s
            if all("all_reduce check passed" in p.output() for p in procs):
                break  # both ranks hold the group now (--hold_s): take the final picture below
            time.sleep(0.005)
        if not all("all_reduce check passed" in p.output() for p in procs):
            self.fail("the job did not pass:\n" + "\n".join(str(p.finish(1)) for p in procs))
        for s in self.sockets_of(pids):
            seen[s[4]] = s

        # The store: listening on addr:MASTER_PORT, and nobody listens on that port elsewhere.
        on_port = [s for s in tcp_sockets() if s[2] == port and s[3] == LISTEN]
        self.assertEqual([describe(s) for s in on_port if s[1] != hex_ipv4(addr)], [],
                         f"something listens on port {port} beyond {addr}")
        self.assertEqual(len(on_port), 1, f"the store does not listen on {addr}:{port}: {on_port}")
        self.assertIn(on_port[0][4], socket_inodes(pids[0]), "the store's socket is not rank 0's")
        for p in procs:
            self.assertEqual(p.finish(30).rc, 0)
        return port, list(seen.values())

    def gloo_sockets(self, port, socks):
        """The sockets that are not the store's (its listener, its connections): Gloo's."""
        gloo = [s for s in socks if port not in (s[2], s[5])]
        self.assertTrue([s for s in gloo if s[3] == "01"], "no Gloo connection between the ranks was seen")
        return gloo

    def test_an_open_store_says_so_on_rank_0_and_a_secret_closes_it(self):
        """Note [Open stores]: ranks started without dtrain-run and without DTRAIN_JOB_SECRET run an open
        store; rank 0, which hosts it, says so in one line naming where it listens."""
        for secret in (None, "a-job-secret-of-more-than-32-bytes-0123456789"):
            port = free_port()
            procs = [self.spawn([hello(), "--timeout_s", 30], rank_env(r, 2, port, DTRAIN_JOB_SECRET=secret))
                     for r in range(2)]
            results = [p.finish(60) for p in procs]
            for res in results:
                self.assertEqual(res.rc, 0, str(res))
            said = [[l for l in res.err.splitlines() if "no job secret" in l] for res in results]
            expected = [f"dtrain: rank 0's store listens on 127.0.0.1 port {port} with no job secret (DTRAIN_JOB_SECRET "
                        "is unset): anyone who reaches that address can read and change the job's keys; set "
                        "DTRAIN_JOB_SECRET (32 bytes or more, one line) on every rank, or start the job with "
                        "dtrain-run, which makes one"]
            self.assertEqual(said, [expected if secret is None else [], []], "\n".join(map(str, results)))

    def test_a_job_secret_is_said_not_to_apply_to_torchruns_store(self):
        """Note [Open stores]: under torchrun's store (a Python TCPStore here, with a rank 1 that never
        comes) a DTRAIN_JOB_SECRET cannot apply, and rank 0 says so instead of ignoring it in silence."""
        port = free_port()
        self.spawn_python_store(FAKE_RANK1, port)
        res = self.run_one([hello(), "--timeout_s", 3],
                           rank_env(0, 2, port, TORCHELASTIC_USE_AGENT_STORE="True",
                                    DTRAIN_JOB_SECRET="a-job-secret-of-more-than-32-bytes-0123456789"), timeout=60)
        self.assertEqual([l for l in res.err.splitlines() if "torchrun hosts" in l],
                         ["dtrain: DTRAIN_JOB_SECRET is set, but torchrun hosts this job's store (its TCPStore, with "
                          "no authentication): the secret does not apply; start the job with dtrain-run to use it"],
                         str(res))

    def test_rank0_store_and_gloo_bind_loopback_only(self):
        port, socks = self.watch_job("127.0.0.1")
        # Every socket the ranks opened (store, store clients, Gloo listeners and pairs): loopback.
        self.assertLoopback(socks, "sockets of the ranks")
        self.gloo_sockets(port, socks)

    def test_gloo_binds_the_interface_that_routes_to_the_master(self):
        addr = non_loopback_ipv4()
        if addr is None:
            self.skipTest("this machine has no IPv4 address besides loopback")
        port, socks = self.watch_job(addr)
        # Not 127.0.0.1 nor 0.0.0.0 nor the host's name: the address that reaches MASTER_ADDR.
        self.assertBound(socks, addr, "sockets of the ranks")
        self.gloo_sockets(port, socks)

    def test_gloo_socket_ifname_overrides_the_route(self):
        addr = non_loopback_ipv4()
        if addr is None:
            self.skipTest("this machine has no IPv4 address besides loopback")
        port, socks = self.watch_job(addr, GLOO_SOCKET_IFNAME="lo")
        store = [s for s in socks if port in (s[2], s[5])]
        self.assertBound(store, addr, "the store's sockets")
        self.assertLoopback(self.gloo_sockets(port, socks), "Gloo's sockets with GLOO_SOCKET_IFNAME=lo")

    def test_gloo_listener_binds_loopback(self):
        # Deterministic view of Gloo's listening socket: rank 0 waits in Gloo's connect for a rank 1
        # that passed the rendezvous check but never connects.
        port = free_port()
        store = self.spawn_python_store(FAKE_RANK1, port)
        rank0 = self.spawn([hello(), "--timeout_s", 8],
                           rank_env(0, 2, port, TORCHELASTIC_USE_AGENT_STORE="True"))
        listeners = []
        deadline = time.monotonic() + 20
        while not listeners and time.monotonic() < deadline and not rank0.ended():
            listeners = [s for s in self.sockets_of([rank0.pid]) if s[3] == LISTEN]
            time.sleep(0.01)
        if not listeners:
            self.fail(f"rank 0 never listened (Gloo):\n{rank0.finish(1)}")
        self.assertLoopback(listeners, "Gloo's listening socket")
        res = rank0.finish(30)  # fails by timeout: rank 1 never comes
        self.assertNotEqual(res.rc, 0, str(res))

    def test_node0_serves_node1_while_a_peer_without_the_secret_attacks_its_store(self):
        # Node 0 with the descriptors of `ulimit -n 256`: 193 idle sockets from a peer without the
        # secret once filled its store's connection cap (192) and node 1, with the secret, failed
        # with "serves 192 connections, its limit"; junk before the handshake was answered, and node
        # 0 said nothing. Now the idle ones are closed oldest first, the junk gets no reply, node 1
        # joins, and node 0 names the peer, one line per kind of refusal.
        port = free_port()
        env = clean_env(DTRAIN_JOB_SECRET="s" * 64)
        argv = [launcher(), "--nnodes", 2, "--nproc_per_node", 1, "--master_addr", "127.0.0.1",
                "--master_port", port, "--rdzv_timeout", 30, "true"]
        node0 = self.spawn(["sh", "-c", 'ulimit -n 256 && exec "$@"', "sh"] + argv[:3] + ["--node_rank", 0] + argv[3:],
                           env)
        deadline = time.monotonic() + 20
        idle = []
        while not idle:  # node 0's store is up
            try:
                idle.append(socket.create_connection(("127.0.0.1", port), timeout=2))
            except OSError:
                if time.monotonic() > deadline or node0.ended():
                    self.fail(f"node 0's store never came up:\n{node0.finish(0)}")
                time.sleep(0.05)
        for _ in range(299):
            idle.append(socket.create_connection(("127.0.0.1", port), timeout=2))
        for _ in range(20):
            with socket.create_connection(("127.0.0.1", port), timeout=2) as junk:
                junk.sendall(b"\x01\x00\x00\x00\x09" * 100)  # truncated AUTH frames
                # Wait for the store to close it (it reads the first frame and sends nothing back):
                # a client that closed first, with the greeting unread, would reset the connection,
                # and the reset discards the frame before the store reads it.
                try:
                    junk.shutdown(socket.SHUT_WR)
                    while junk.recv(4096):
                        pass
                except OSError:  # closed already (reset): the store read the frame or evicted it
                    pass
        time.sleep(0.2)
        started = time.monotonic()
        node1 = subprocess.run([str(a) for a in argv[:3] + ["--node_rank", 1] + argv[3:]], env=env,
                               capture_output=True, text=True, timeout=60)
        took = time.monotonic() - started
        for sock in idle:
            sock.close()
        res0 = node0.finish(60)
        self.assertEqual(node1.returncode, 0, node1.stderr)
        self.assertEqual(res0.rc, 0, str(res0))
        self.assertLess(took, 20, node1.stderr)
        self.assertNotIn("its limit", node1.stderr)
        for kind in ("still without the handshake", "is not a well-formed handshake"):
            lines = [l for l in res0.err.splitlines() if kind in l]
            self.assertEqual(len(lines), 1, f"node 0 names each kind of refusal once:\n{res0.err}")
            self.assertIn("from 127.0.0.1:", lines[0])
        self.assertRegex(res0.err, r"the rendezvous store refused \d+ connection\(s\)")
        self.assertNotIn("error", res0.err.lower(), str(res0))


if __name__ == "__main__":
    unittest.main()
