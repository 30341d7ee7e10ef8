"""Pods for the cluster tests: network namespaces (netns_hosts.Hosts) whose processes run in a mount
namespace of their own, with their own /etc/hosts and resolv.conf, which the test edits while they run,
as a cluster's DNS learns the rank-0 pod's name late. Python 3 stdlib; needs root.

torchx_command() writes TorchX's dist.ddp command line (meta-pytorch/torchx, torchx/components/dist.py)."""
import os
import shlex
import subprocess

from proc_util import wait_until


def torchx_command(torchrun, script, app_id, nnodes, nproc, *script_args, rdzv_port=29500):
    """The bash command line TorchX's dist.ddp component writes: the endpoint unquoted so that bash
    expands $TORCHX_RANK0_HOST (or localhost:0 for one node), every other argument shlex-quoted,
    `--role ''` included."""
    # One node: a free port on localhost; several: the rank-0 host the scheduler names.
    single = str(nnodes).split(":")[-1] == "1"
    endpoint = "localhost:0" if single else f"${{TORCHX_RANK0_HOST:=localhost}}:{rdzv_port}"
    args = [torchrun, "--rdzv_backend", "c10d", "--rdzv_endpoint", None, "--rdzv_id", app_id, "--nnodes", str(nnodes),
            "--nproc_per_node", str(nproc), "--tee", "3", "--role", "", script, *[str(a) for a in script_args]]
    return " ".join(endpoint if a is None else shlex.quote(a) for a in args)


class PodNames:
    """Pod i's /etc/hosts and resolv.conf in `folder` (a resolver that answers nothing, at once)."""

    def __init__(self, folder, n):
        self.files = []
        for i in range(n):
            hosts, resolv = os.path.join(folder, f"hosts{i}"), os.path.join(folder, f"resolv{i}")
            with open(hosts, "w") as f:
                f.write("127.0.0.1 localhost\n")
            with open(resolv, "w") as f:
                f.write("nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")
            self.files.append((hosts, resolv))

    def argv(self, i, command):
        """argv running the shell `command` (bash) with pod i's name files."""
        hosts, resolv = self.files[i]
        return ["unshare", "--mount", "sh", "-c",
                f"mount --bind {hosts} /etc/hosts && mount --bind {resolv} /etc/resolv.conf && exec bash -c "
                + shlex.quote(command)]

    def publish(self, addr, name):
        """The DNS record appears in every pod: appended in place, as the bind mounts see the files."""
        for hosts, _ in self.files:
            with open(hosts, "a") as f:
                f.write(f"{addr} {name}\n")


def launch_pod(ns, argv, env, stderr=subprocess.PIPE):
    """Popen of argv in network namespace `ns`, in a session of its own (so that a pod still running at a
    timeout dies whole: proc_util.kill_session); stdout a pipe, stderr a pipe or the file given."""
    return subprocess.Popen(["ip", "netns", "exec", ns, *[str(a) for a in argv]], env=env, stdout=subprocess.PIPE,
                            stderr=stderr, text=True, start_new_session=True)


def launch_waiting_pods(hosts, names, commands, envs, folder, waiting, timeout=60):
    """Launches commands[i] (bash) in pod i of `hosts` with envs[i], its stderr in a file of `folder`,
    and waits until every pod has printed `waiting` (the line a launcher or trainer prints while the
    rank-0 name does not resolve) or one has ended: publishing the name only then keeps a pod that
    starts slowly on a loaded machine from finding it already there. Returns (pods, said, alive):
    said(i) reads pod i's stderr so far, alive[i] is whether pod i still ran once all had waited."""
    err_paths = [os.path.join(folder, f"pod{i}.stderr") for i in range(len(commands))]
    pods = []
    for i, command in enumerate(commands):
        with open(err_paths[i], "w") as err:
            pods.append(launch_pod(hosts.ns[i], names.argv(i, command), envs[i], stderr=err))

    def said(i):
        with open(err_paths[i]) as f:
            return f.read()
    wait_until(lambda: all(waiting in said(i) for i in range(len(pods))) or any(p.poll() is not None for p in pods),
               timeout)
    return pods, said, [p.poll() is None for p in pods]
