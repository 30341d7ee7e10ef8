"""What the Python references of the tests against PyTorch share (run by .venv's Python 2.x, from
tests/dist/): the deterministic values both languages compute alike, and the end of a run."""
import gc
import json

import torch
import torch.distributed as dist


def wave(n, scale, freq, phase):
    """Values C++ computes alike (no random generator is shared between the languages)."""
    return torch.arange(n, dtype=torch.float64).mul(freq).add(phase).sin().mul(scale)


def write_and_close(out, path):
    """Writes this rank's JSON, then ends the process group. Nothing that holds the group may outlive
    it: modules in reference cycles (fully_shard's hooks hold their module) are freed here, not at
    interpreter exit, where Gloo's threads once joined too late and aborted the rank ("terminate
    called without an active exception", exit -6). Both ranks are past their last exchange before
    either closes its Gloo pairs."""
    with open(path, "w") as f:
        json.dump(out, f)
    end_group()


def end_group():
    """Ends the process group as write_and_close says: cycles collected, then every rank past its
    last exchange before any closes its Gloo pairs."""
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
