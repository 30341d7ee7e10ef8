"""Python and C++ ranks training one model with DistributedDataParallel (InitOptions().pytorch_peers).

The Python ranks run tests/dist/ddp_peer_train.py (PyTorch 2.x from .venv: torch.nn.parallel's DDP,
torch.optim.Adam), the C++ ranks the dtrain program ddp_peer_train (dtrain::DistributedDataParallel
and an Adam that repeats PyTorch's op for op), in one process group of 3 ranks. Both run the same
float64 steps, so a mixed job must compute what an all-Python job computes:
- every rank exits 0 and ran the language its position asked for;
- after every step, the parameters are the same bits on every rank of the job (each rank writes its
  parameters and BatchNorm buffers after every step: ddp_peer_train.py describes the file);
- every value, buffers included, equals the same rank's value in the all-Python job of that mode
  (the reference, run once per mode): bit for bit, although 1e-12 would do. The buffers are
  compared per rank, not across ranks:
  after a forward each rank's running statistics hold its own batch until DDP broadcasts rank 0's
  before the next forward.
Modes: `unused` (find_unused_parameters; steps where every rank, one rank or none uses a branch,
no_sync steps among them) with a Python and a C++ rank 0, 2 Python + 1 dtrain and 1 Python + 2 dtrain;
`default` (the bucket rebuild after the first step), `bucketview` (gradient_as_bucket_view) and
`static` (static_graph, a branch never used), `small` and `smallunused` (bucket_cap_mb=0.001:
several buckets, rebuilt or not), `join` and `joindefault` (unused and default with uneven inputs
under Join: rank r runs 7 r steps fewer, then writes the model after the Join), one layout each. A
job runs its layout's modes one after another in one process group (fresh models, DDPs and
optimizers), so a mode also starts from whatever the modes before it left in the group. And `unused` with
TORCH_DISTRIBUTED_DEBUG=DETAIL on every rank (the dtrain rank takes part in the checks that Python's
ProcessGroupWrapper adds before every collective; ddp_peer_train.py leaves out the log of DDP's
construction there, which segfaults in PyTorch 2.15 on a Gloo group DETAIL wrapped, with no dtrain
rank in the job). Both languages read the group timeout from $DTRAIN_TIMEOUT_S, so ranks that
disagree on a call fail within seconds instead of waiting for the job's deadline.

Env: $DDP_PEER_TRAIN (the C++ program), $VENV_PYTHON, $DTRAIN_TORCH_MAJOR (set by tests/dist/CMakeLists.txt).
"""
import os
import shutil
import struct
import tempfile
import unittest

from harness import DistTestCase, binary

HERE = os.path.dirname(os.path.abspath(__file__))
TORCH_MAJOR = int(os.environ.get("DTRAIN_TORCH_MAJOR", "0"))
VENV_PYTHON = os.environ.get("VENV_PYTHON", "")
STEPS = 50
# Values a rank writes after each step: fc1 (8*16 + 16), bn (16 + 16), fc2 and branch (16*4 + 4 each)
# parameters, then bn's running_mean and running_var (16 + 16).
PARAMS = 8 * 16 + 16 + 16 + 16 + 2 * (16 * 4 + 4)
VALUES = PARAMS + 16 + 16
# Within 1e-12 would do for a user; the jobs give the same bits, and the test holds them to that.
TOLERANCE = 0.0
# dtrain's own calls divide after summing and sum in another order: 50 Adam steps stay within this.
ROUNDING = 1e-8
# A job takes seconds. Ranks that disagree on a call wait in it: the group timeout (both languages
# read $DTRAIN_TIMEOUT_S) makes every rank fail with its error well before the job's deadline, so
# that 8 hanging mixed jobs stay within ctest's 600 s (whose kill would swallow every message).
COLLECTIVE_TIMEOUT_S = 30
JOB_TIMEOUT_S = 120
LANGUAGE = {"py": "Python", "cxx": "C++"}


def needs(path, what):
    if not path or not os.access(path, os.X_OK):
        raise unittest.SkipTest(f"{what} is missing ({path!r}): run scripts/setup.sh and build the tree")
    return path


def ddp_peer_train():
    """The C++ side: a missing $DDP_PEER_TRAIN (set by CMake) fails the test, as every built program does."""
    return needs(binary("DDP_PEER_TRAIN", "ddp_peer_train"), "ddp_peer_train")


def read_steps(path, records=STEPS):
    """The file of one rank: a list of steps, each a list of VALUES floats (and its raw bytes per step)."""
    with open(path, "rb") as f:
        data = f.read()
    size = VALUES * 8
    if len(data) != records * size:
        raise AssertionError(f"{path}: {len(data)} bytes, expected {records} records of {VALUES} float64")
    raw = [data[s * size:(s + 1) * size] for s in range(records)]
    return [list(struct.unpack(f"<{VALUES}d", r)) for r in raw], raw


# Every mode, and the modes each layout of a mixed job runs (one job per layout: a job's processes
# start once, and their start is most of a short job's time). Each mode runs in at least one layout
# with a Python and one with a C++ rank 0 where it matters (`unused` in all four).
MODES = ("unused", "default", "bucketview", "static", "small", "smallunused", "join", "joindefault", "ignored")


def synced(mode):
    """Values every rank holds alike: the parameters, less the branch's (written last: weight and
    bias, 16 * 4 + 4) where DDP ignores them and each rank trains its own."""
    return PARAMS - (16 * 4 + 4) if mode == "ignored" else PARAMS


def records(mode, rank):
    """Records a rank writes: one per step; under Join rank r runs 7 r steps fewer, then writes the
    model the Join left it with."""
    return STEPS - 7 * rank + 1 if mode.startswith("join") else STEPS


@unittest.skipUnless(TORCH_MAJOR >= 2, "needs a LibTorch 2.x build (the Python ranks' PyTorch)")
class PytorchPeersDDP(DistTestCase):
    # The all-Python job of every mode, run by the first test that needs it: {mode: [rank files]}.
    references = {}

    def run_job(self, kinds, modes, extra=(), **env):
        """Runs one job of the modes in order (a fresh folder); checks every rank's exit and language;
        returns {mode: its files} and every rank's output."""
        cxx = ddp_peer_train() if "cxx" in kinds else None
        py = [needs(VENV_PYTHON, ".venv/bin/python"), os.path.join(HERE, "ddp_peer_train.py")]
        out = tempfile.mkdtemp(prefix="ddp_peer_")
        self.addCleanup(shutil.rmtree, out, ignore_errors=True)
        args = ["--mode", ",".join(modes), "--steps", str(STEPS), "--out", out, *extra]
        world = len(kinds)
        results, _ = self.run_world([(py if k == "py" else [cxx]) + args for k in kinds], JOB_TIMEOUT_S,
                                    DTRAIN_TIMEOUT_S=COLLECTIVE_TIMEOUT_S, **env)
        everything = "\n".join(f"=== rank {r} ({k})\n{res}" for r, (k, res) in enumerate(zip(kinds, results)))
        for r, (kind, res) in enumerate(zip(kinds, results)):
            self.assertEqual(res.rc, 0, f"rank {r} ({kind}) of {kinds}, modes {modes}, failed:\n{everything}")
            self.assertIn("ddp_peer_train: ALL OK", res.out, f"rank {r} ({kind}):\n{everything}")
            self.assertEqual([l for l in res.out.splitlines() if l.startswith("ddp_peer_train: language ")],
                             [f"ddp_peer_train: language {LANGUAGE[kind]}"],
                             f"rank {r} is not the {kind} side:\n{everything}")
        files = {mode: [read_steps(os.path.join(out, mode, f"rank{r}.bin"), records(mode, r)) for r in range(world)]
                 for mode in modes}
        return files, everything

    def reference(self, mode):
        if not PytorchPeersDDP.references:
            PytorchPeersDDP.references, _ = self.run_job(["py", "py", "py"], MODES)
        return PytorchPeersDDP.references[mode]

    def check_layout(self, kinds, modes, **env):
        jobs, everything = self.run_job(kinds, modes, **env)
        for mode in modes:
            self.check_mode(kinds, mode, jobs[mode], everything, env)

    def check_mode(self, kinds, mode, files, everything, env):
        ref = self.reference(mode)
        what = f"{kinds}, mode {mode}" + "".join(f", {k}={v}" for k, v in env.items())
        # Parameters: the same bits on every rank after every step all of them ran, and (Join) in the
        # final model (the first record that differs is named).
        for r in range(1, len(kinds)):
            common = [(step, step) for step in range(min(len(files[r][1]), len(files[0][1])) - 1)]
            common.append((len(files[r][1]) - 1, len(files[0][1]) - 1))
            for step, step0 in common:
                n = synced(mode)
                if files[r][1][step][:n * 8] != files[0][1][step0][:n * 8]:
                    diff = max(abs(a - b) for a, b in zip(files[r][0][step][:n], files[0][0][step0][:n]))
                    self.fail(f"{what}: after step {step} rank {r} ({kinds[r]}) holds other parameters than "
                              f"rank 0 ({kinds[0]}), by up to {diff:.3g}\n{everything}")
        # Every value against the all-Python job's same rank.
        for r in range(len(kinds)):
            for step in range(records(mode, r)):
                got, want = files[r][0][step], ref[r][0][step]
                worst = max(range(VALUES), key=lambda i: abs(got[i] - want[i]))
                if not abs(got[worst] - want[worst]) <= TOLERANCE:
                    where = "parameter" if worst < PARAMS else "buffer"
                    self.fail(f"{what}: after step {step} rank {r} ({kinds[r]}) differs from the all-Python job: "
                              f"{where} value {worst} is {got[worst]!r}, Python's {want[worst]!r}\n{everything}")

    def test_all_python_reference_is_deterministic(self):
        # The reference itself: a second all-Python job gives the same bytes in every mode, and every
        # rank holds the same parameters (else the comparisons below could not be exact).
        again, everything = self.run_job(["py", "py", "py"], MODES)
        for mode in MODES:
            ref = self.reference(mode)
            for r in range(3):
                self.assertEqual(again[mode][r][1], ref[r][1], f"{mode}, rank {r}: two all-Python jobs differ")
            if mode.startswith("join"):
                continue  # ranks run different step counts; check_mode compares their final models
            for r in range(3):
                for step in range(STEPS):
                    n = synced(mode)
                    self.assertEqual(again[mode][r][1][step][:n * 8], again[mode][0][1][step][:n * 8],
                                     f"{mode}, rank {r} step {step}: parameters differ across Python ranks")

    # --- each layout of 2 + 1 and 1 + 2 ranks, with a Python and a C++ rank 0 ---------------------
    def test_two_python_one_cxx_python_rank_0(self):
        # gradient_as_bucket_view; Join with the bucket rebuild; several buckets with unused parameters
        # (the initial assignment, 1048-byte buckets reversed, used every step).
        self.check_layout(["py", "cxx", "py"], ["unused", "bucketview", "joindefault", "smallunused"])

    def test_two_python_one_cxx_cxx_rank_0(self):
        # The default options: the bucket rebuild after the first step, in rank 0's order. ignored:
        # the C++ rank 0 broadcasts, checks and averages all but the branch, as Python's DDP with
        # _set_params_and_buffers_to_ignore_for_model (each rank's branch its own).
        self.check_layout(["cxx", "py", "py"], ["unused", "default", "ignored"])

    def test_one_python_two_cxx_python_rank_0(self):
        self.check_layout(["py", "cxx", "cxx"], ["unused", "static", "ignored"])

    def test_one_python_two_cxx_cxx_rank_0(self):
        # Python's Join and dtrain's: the joined ranks shadow the others (buffers from the highest
        # active rank, zeros for every bucket, the used map as they last reduced it), and every rank
        # ends with the model of the highest rank that ran last. bucket_cap_mb=0.001: the buckets
        # rebuilt after the first step are several, in rank 0's order.
        self.check_layout(["cxx", "py", "cxx"], ["unused", "join", "small"])

    def test_unused_with_torch_distributed_debug_detail(self):
        # Python wraps the group in c10d's ProcessGroupWrapper (a fingerprint check before every
        # collective) and DDP logs more; the dtrain rank must take part in every one.
        self.check_layout(["py", "cxx", "py"], ["unused", "join"], TORCH_DISTRIBUTED_DEBUG="DETAIL")

    def test_dtrain_alone_keeps_pytorchs_semantics(self):
        # Three dtrain ranks with dtrain's own calls (shared memory, its buckets, division after the
        # sum) compute what Python's DDP computes up to rounding: buffers broadcast only before a
        # forward that follows a synchronized one, and a parameter used only under no_sync counts as
        # used at the next synchronized step (before either, the buffers differed from step 4 and the
        # branch by 7.7e-3 from step 9).
        jobs, everything = self.run_job(["cxx", "cxx", "cxx"], ["unused"], extra=["--dtrain-only"])
        ref, files = self.reference("unused"), jobs["unused"]
        for r in range(3):
            for step in range(STEPS):
                got, want = files[r][0][step], ref[r][0][step]
                worst = max(range(VALUES), key=lambda i: abs(got[i] - want[i]))
                self.assertLessEqual(abs(got[worst] - want[worst]), ROUNDING,
                                     f"rank {r} after step {step}: value {worst} is {got[worst]!r}, Python's "
                                     f"{want[worst]!r}\n{everything}")


if __name__ == "__main__":
    unittest.main()
