"""Hosts for multi-node tests: network namespaces on one bridge, each with an address of the test's own
(10.232.<pid % 250 + 1>.<i + 1>). Python 3 stdlib and iproute2; needs root."""
import os
import shutil
import subprocess


def netns_unavailable():
    """Why this machine cannot make the hosts (a skip reason), or None."""
    if os.geteuid() != 0 or not shutil.which("ip"):
        return "needs root and iproute2 to create network namespaces"
    try:
        Hosts(1).close()
    except (subprocess.CalledProcessError, OSError) as e:
        return f"cannot create network namespaces here: {(getattr(e, 'stderr', '') or str(e)).strip()}"
    return None


class Hosts:
    """n network namespaces joined by a bridge in the first one; host i has address self.addr[i]."""

    def __init__(self, n):
        pid = os.getpid()
        self.ns = [f"dtre{pid}x{i}" for i in range(n)]
        sub = pid % 250 + 1
        self.addr = [f"10.232.{sub}.{i + 1}" for i in range(n)]
        self.created = []
        try:
            for ns in self.ns:
                self.ip("netns", "add", ns)
                self.created.append(ns)
                self.ip("-n", ns, "link", "set", "lo", "up")
            self.ip("-n", self.ns[0], "link", "add", "br0", "type", "bridge")
            self.ip("-n", self.ns[0], "addr", "add", self.addr[0] + "/24", "dev", "br0")
            self.ip("-n", self.ns[0], "link", "set", "br0", "up")
            for i in range(1, n):
                a, b = f"dtea{pid}x{i}"[:15], f"dteb{pid}x{i}"[:15]
                self.ip("link", "add", a, "type", "veth", "peer", "name", b)
                self.ip("link", "set", a, "netns", self.ns[0])
                self.ip("-n", self.ns[0], "link", "set", a, "master", "br0")
                self.ip("-n", self.ns[0], "link", "set", a, "up")
                self.ip("link", "set", b, "netns", self.ns[i])
                self.ip("-n", self.ns[i], "addr", "add", self.addr[i] + "/24", "dev", b)
                self.ip("-n", self.ns[i], "link", "set", b, "up")
        except (subprocess.CalledProcessError, OSError):
            self.close()
            raise

    @staticmethod
    def ip(*args):
        subprocess.run(["ip", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=10,
                       check=True)

    def close(self):
        for ns in self.created:  # deleting a namespace deletes its veth ends
            subprocess.run(["ip", "netns", "del", ns], stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=10)
        self.created = []

    def launch(self, i, argv, env):
        """Popen of argv on host i. `ip netns exec` execs argv[0], so the Popen's pid is the program's."""
        return subprocess.Popen(["ip", "netns", "exec", self.ns[i]] + [str(a) for a in argv], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
