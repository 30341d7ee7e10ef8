"""A one-machine Slurm cluster of a test's own: munged, slurmctld and slurmd (Debian's slurm-wlm 22.05
and munge) started as children of the test with a configuration under a temporary folder.

Everything the daemons write (key, sockets, pid and state files, spool, logs) lives in that folder,
the daemons listen on 127.0.0.1 only, on ports picked free at start, and the clients (srun, sbatch,
scancel, squeue) find the cluster through SLURM_CONF in the environment `env()` returns. The daemons
run in the foreground as this process's children, so stop() ends exactly the processes start()
began (their pids, never by name), also after a failed start.

Slurm's slurmd starts tasks as their user, which needs root: the cluster skips the test elsewhere.

  cluster = SlurmCluster(); cluster.start()   # raises unittest.SkipTest where it cannot run
  subprocess.run(["srun", "-n", "2", "hostname"], env=cluster.env())
  cluster.stop()
"""
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import unittest

from harness import clean_env, free_port, free_slurm_job_id, wait_until

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("srun", "sbatch", "scancel", "squeue", "sinfo", "scontrol")
INSTALL_HINT = "scripts/setup.sh, or apt-get install munge slurmctld slurmd slurm-client"
CPUS = 8  # declared to Slurm (config_overrides): srun -n 3 fits on a 2-core machine
START_TIMEOUT_S = 60


def missing_programs():
    return [p for p in DAEMONS + CLIENTS if not shutil.which(p, path=os.environ.get("PATH", "") + ":/usr/sbin")]


class SlurmCluster:
    def __init__(self):
        self.dir = None
        self.procs = {}  # daemon name -> Popen
        self.node = socket.gethostname().split(".")[0]
        self.first_job_id = None

    # --- paths and environment -----------------------------------------------------------------------
    def path(self, *parts):
        return os.path.join(self.dir, *parts)

    def env(self, **extra):
        """The clients' environment: no launcher variables of the test's own, SLURM_CONF of this cluster."""
        return clean_env(SLURM_CONF=self.path("slurm.conf"), **extra)

    def log(self, daemon):
        try:
            with open(self.path("log", f"{daemon}.log"), errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def logs(self):
        return "".join(f"--- {d} log (last 30 lines)\n" + "\n".join(self.log(d).splitlines()[-30:]) + "\n"
                       for d in DAEMONS)

    # --- start / stop --------------------------------------------------------------------------------
    def start(self):
        missing = missing_programs()
        if missing:
            raise unittest.SkipTest(f"Slurm is not installed ({' '.join(missing)} missing): {INSTALL_HINT}")
        if os.geteuid() != 0:
            raise unittest.SkipTest("slurmd starts tasks as their user, which needs root")
        self.dir = tempfile.mkdtemp(prefix="dtrain-slurm-")
        try:
            self._write_files()
            self._start_munge()
            self._spawn("slurmctld", ["slurmctld", "-D", "-f", self.path("slurm.conf")])
            self._spawn("slurmd", ["slurmd", "-D", "-f", self.path("slurm.conf"), "-N", self.node])
            self._wait_idle()
        except BaseException:
            self.stop()
            raise

    def stop(self):
        """Cancels the cluster's jobs, stops each daemon this cluster started (SIGTERM, SIGKILL after
        10 s; slurmd first), SIGKILLs whatever of the cluster outlived them (a step's slurmstepd or
        tasks), then removes the folder. Returns the leftovers it had to kill ("pid: command")."""
        if self.procs.get("slurmctld") and self.procs["slurmctld"].poll() is None:
            self._client(["scancel", "--user", str(os.geteuid())])
            wait_until(lambda: not self._client(["squeue", "-h"]).strip(), timeout=15, step=0.25)
        for name in reversed(DAEMONS):
            p = self.procs.pop(name, None)
            if p is None:
                continue
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        leftovers = []
        if self.dir:
            leftovers = self.processes()
            for line in leftovers:
                try:
                    os.kill(int(line.split(":", 1)[0]), signal.SIGKILL)
                except OSError:
                    pass
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None
        return leftovers

    def processes(self):
        """Live processes of this cluster but its daemons ("pid: command"): slurmd and srun hand the
        environment on, so every slurmstepd and task of it carries SLURM_CONF=<this slurm.conf>."""
        mine = f"SLURM_CONF={self.path('slurm.conf')}".encode()
        daemons = {p.pid for p in self.procs.values()}
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            if int(pid) in daemons or int(pid) == os.getpid():
                continue
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    if mine not in f.read().split(b"\0"):
                        continue
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
                with open(f"/proc/{pid}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                        continue
            except OSError:
                continue
            found.append(f"{pid}: {cmd}")
        return found

    def _client(self, argv):
        r = subprocess.run(argv, env=self.env(), capture_output=True, text=True, timeout=30)
        return r.stdout

    def _spawn(self, name, argv):
        out = open(self.path("log", f"{name}.out"), "w")
        try:
            # Its own session: a terminal's signals to the test do not reach it before stop() does.
            self.procs[name] = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                                stdin=subprocess.DEVNULL, start_new_session=True,
                                                env=self.env())
        finally:
            out.close()

    def _start_munge(self):
        key = self.path("munge", "munge.key")
        with open(key, "wb") as f:
            f.write(os.urandom(1024))
        os.chmod(key, 0o400)
        self._spawn("munged", ["munged", "-F", "--key-file", key, "--socket", self.path("munge", "munge.sock"),
                               "--pid-file", self.path("munge", "munged.pid"),
                               "--seed-file", self.path("munge", "munged.seed"),
                               "--log-file", self.path("log", "munged.log"), "--num-threads", "2"])
        if not wait_until(lambda: os.path.exists(self.path("munge", "munge.sock")) or
                          self.procs["munged"].poll() is not None, timeout=10):
            raise AssertionError(f"munged did not create its socket within 10 s\n{self.logs()}")
        if self.procs["munged"].poll() is not None:
            raise AssertionError(f"munged exited with {self.procs['munged'].returncode}\n{self.logs()}"
                                 f"{open(self.path('log', 'munged.out')).read()}")

    def _wait_idle(self):
        """Until sinfo shows the node idle, or a daemon exits, or START_TIMEOUT_S passes."""
        state = [""]

        def idle():
            for name, p in self.procs.items():
                if p.poll() is not None:
                    raise AssertionError(f"{name} exited with {p.returncode} while the cluster started\n"
                                         f"{self.logs()}")
            r = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], env=self.env(), capture_output=True, text=True,
                               timeout=30)
            state[0] = (r.stdout + r.stderr).strip()
            return r.returncode == 0 and state[0] == "idle"

        if not wait_until(idle, timeout=START_TIMEOUT_S, step=0.25):
            raise AssertionError(f"the node is not idle after {START_TIMEOUT_S} s (sinfo: {state[0]!r})\n"
                                 f"{self.logs()}")

    def _write_files(self):
        # munged wants its socket's folders searchable by every user (its clients may be anyone).
        os.chmod(self.dir, 0o711)
        for d in ("munge", "state", "spool", "log"):
            os.mkdir(self.path(d), 0o711 if d == "munge" else 0o700)
        # Jobs meet at ports derived from their ids: ids whose ports are free (proc_util.free_slurm_job_id).
        self.first_job_id = free_slurm_job_id(32)
        conf = {
            "ClusterName": "dtraintest",
            "SlurmctldHost": f"{self.node}(127.0.0.1)",
            "SlurmctldPort": free_port(),
            "SlurmdPort": free_port(),
            "SlurmUser": "root",
            "SlurmdUser": "root",
            "AuthType": "auth/munge",
            "CredType": "cred/munge",
            "AuthInfo": f"socket={self.path('munge', 'munge.sock')}",
            "StateSaveLocation": self.path("state"),
            "SlurmdSpoolDir": self.path("spool"),
            "SlurmctldPidFile": self.path("slurmctld.pid"),
            "SlurmdPidFile": self.path("slurmd.pid"),
            "SlurmctldLogFile": self.path("log", "slurmctld.log"),
            "SlurmdLogFile": self.path("log", "slurmd.log"),
            "SlurmctldDebug": "info",
            "SlurmdDebug": "info",
            # No cgroups: tasks are tracked through their parent pids, and bound to no cores.
            "ProctrackType": "proctrack/linuxproc",
            "TaskPlugin": "task/none",
            "SwitchType": "switch/none",
            "MpiDefault": "none",
            "JobAcctGatherType": "jobacct_gather/none",
            "AccountingStorageType": "accounting_storage/none",
            "JobCompType": "jobcomp/none",
            "SelectType": "select/cons_tres",
            "SelectTypeParameters": "CR_CPU",
            # The node declares CPUS cores whatever the machine has.
            "SlurmdParameters": "config_overrides",
            "ReturnToService": 2,
            "FirstJobId": self.first_job_id,
            # Fast turnaround: scancel's SIGKILL follows SIGTERM after 2 s; finished jobs leave at once.
            "KillWait": 2,
            "MinJobAge": 2,
            "SchedulerParameters": "sched_interval=1",
        }
        lines = [f"{k}={v}" for k, v in conf.items()]
        lines.append(f"NodeName={self.node} NodeAddr=127.0.0.1 CPUs={CPUS} RealMemory=1000 State=UNKNOWN")
        lines.append(f"PartitionName=debug Nodes={self.node} Default=YES MaxTime=INFINITE State=UP")
        with open(self.path("slurm.conf"), "w") as f:
            f.write("\n".join(lines) + "\n")
