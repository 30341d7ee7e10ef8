"""A worker for the elastic launcher tests (tests/launcher/test_elastic.py), standing in for a trainer.

Usage: elastic_worker.py DIR STEPS STEP_SECONDS MARKER

It appends one line with what the launcher gave it (RANK, WORLD_SIZE, GROUP_RANK, GROUP_WORLD_SIZE,
TORCHELASTIC_RESTART_COUNT, its pid) to DIR/log, then runs STEPS steps. Each step is a barrier over
files with every rank of the attempt (DIR/a<restart>/r<rank> holds the last step a rank finished),
so, like a collective, a dead peer blocks the others until their launcher stops them. After each
step rank 0 appends "RESTART WORLD STEP" to DIR/steps, then writes the step count to DIR/ckpt (write +
rename: a checkpoint is whole or absent), and a restarted group resumes from it, as a trainer resumes
from dtrain's checkpoint; DIR/steps then lists every step once, on the attempt that checkpointed it. Once DIR/finish exists
every rank leaves its loop and exits 0, so a test ends a long job the moment it has seen what it waits for.
"""
import os
import sys
import time

folder, steps, step_s = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
restart = os.environ["TORCHELASTIC_RESTART_COUNT"]
ckpt = os.path.join(folder, "ckpt")
mine = os.path.join(folder, f"a{restart}")
os.makedirs(mine, exist_ok=True)


def read_int(path):
    try:
        with open(path) as f:
            return int(f.read() or -1)
    except (OSError, ValueError):
        return -1


def write_int(path, value):
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(str(value))
    os.replace(tmp, path)


first = max(0, read_int(ckpt))
steps_log = os.path.join(folder, "steps")
if rank == 0 and os.path.exists(steps_log):
    # Steps past the checkpoint are trained again by this attempt: their lines from the stopped one go.
    with open(steps_log) as f:
        kept = [line for line in f if line.endswith("\n") and int(line.split()[2]) < first]
    with open(steps_log + ".tmp", "w") as f:
        f.writelines(kept)
    os.replace(steps_log + ".tmp", steps_log)
with open(os.path.join(folder, "log"), "a") as f:
    f.write(f"start rank={rank} world={world} group={os.environ['GROUP_RANK']} "
            f"groups={os.environ['GROUP_WORLD_SIZE']} restart={restart} step={first} pid={os.getpid()} "
            f"launcher={os.getppid()}\n")
finish = os.path.join(folder, "finish")
for step in range(first, steps):
    time.sleep(step_s)
    write_int(os.path.join(mine, f"r{rank}"), step)
    while any(read_int(os.path.join(mine, f"r{r}")) < step for r in range(world)) and not os.path.exists(finish):
        time.sleep(0.01)
    if os.path.exists(finish):
        break
    if rank == 0:
        # The step's line first, then the checkpoint: a worker stopped between the two leaves a line the
        # next attempt drops (below), never a checkpointed step without its line.
        with open(steps_log, "a") as f:
            f.write(f"{restart} {world} {step}\n")
        write_int(ckpt, step + 1)
