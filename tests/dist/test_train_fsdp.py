"""examples/train_fashion_mnist --fsdp: the main job under fully_shard on real ranks.

  * --fsdp on 2 ranks ends bit for bit with DDP's parameters (the same params_sha256, as README
    says), with --reshard_after_forward true (ZeRO-3) and false (ZeRO-2), and the ranks agree on the
    whole parameters;
  * its checkpoints are written by every rank, each its part of a DCP folder beside rank 0's main file;
    a run resumed from them on the same world ends bit for bit as one never stopped, and on another
    world size (2 -> 3) it resumes resharded with exactly the saved parameters (the checkpoint is
    written after the epoch's last step, so a run resumed with the same --epochs trains no step and
    dumps what it loaded; a run that started over would dump other parameters) and finishes in sync;
  * --fsdp with DDP-only flags (--comm_hook, --uneven) and --reshard_after_forward without --fsdp
    are refused with one line.

Binaries: $TRAIN_FASHION_MNIST and $DTRAIN_RUN (set by tests/dist/CMakeLists.txt), else build*/bin.
"""
import array
import glob
import os
import re
import shutil
import tempfile
import unittest

from harness import DistTestCase, clean_env, launcher, trainer

RESULT_RE = re.compile(r"^(?:\[rank 0\] )?RESULT epochs=(\d+) test_accuracy=([0-9.]+) train_loss=([0-9.]+)"
                       r" params_sha256=([0-9a-f]{64}) ranks_agree=([01])$")
# 256 samples, 2 ranks x batch 32: 4 steps per epoch; the test set's first 512 samples.
COMMON = ("--subset", 256, "--seed", 3, "--threads", 1, "--optimizer", "sgd", "--lr", 0.05, "--test_subset", 512)
RUN_TIMEOUT_S = 150


class TrainFsdp(DistTestCase):
    def launch(self, nproc, *args, rc=0):
        res = self.run_one([launcher(), "--standalone", "--nproc_per_node", nproc, "--grace_period", 2,
                            trainer(), *args], clean_env(DTRAIN_TIMEOUT_S=60), timeout=RUN_TIMEOUT_S)
        self.assertEqual(res.rc, rc, str(res))
        if rc != 0:
            return res, None
        lines = res.out.strip().splitlines()
        m = RESULT_RE.match(lines[-1]) if lines else None
        self.assertIsNotNone(m, f"the last line is not the RESULT line:\n{res}")
        self.assertEqual(m.group(5), "1", f"the ranks' whole parameters differ:\n{res}")
        return res, m

    @staticmethod
    def read(path):
        values = array.array("f")
        with open(path, "rb") as f:
            values.frombytes(f.read())
        return values

    def test_fsdp_ends_with_ddps_parameters(self):
        with tempfile.TemporaryDirectory() as tmp:
            ddp = os.path.join(tmp, "ddp.bin")
            _, ddp_result = self.launch(2, *COMMON, "--epochs", 2, "--dump_params", ddp)
            for reshard in ("true", "false"):
                with self.subTest(reshard_after_forward=reshard):
                    mine = os.path.join(tmp, f"fsdp_{reshard}.bin")
                    res, fsdp_result = self.launch(2, *COMMON, "--epochs", 2, "--fsdp", "--reshard_after_forward",
                                                   reshard, "--dump_params", mine)
                    self.assertIn(f"fully_shard (reshard_after_forward {reshard})", res.out)
                    a, b = self.read(ddp), self.read(mine)
                    self.assertEqual(len(a), 421642, "parameter count of conv32-conv64-fc128-fc10")
                    self.assertEqual(len(a), len(b))
                    # On 2 ranks the reduce-scatter adds the same two gradients as DDP's all-reduce
                    # (a + b either way), then both divide by 2: the same bits, as README claims.
                    differ = sum(1 for x, y in zip(a, b) if x != y)
                    self.assertEqual(differ, 0, f"--fsdp ended with {differ} parameters other than DDP's")
                    self.assertEqual(fsdp_result.group(4), ddp_result.group(4), "params_sha256 differs from DDP's")

    def test_checkpoints_are_sharded_and_resume_exactly_and_on_another_world(self):
        with tempfile.TemporaryDirectory() as tmp:
            _, straight = self.launch(2, *COMMON, "--epochs", 2, "--fsdp")
            ckpt = os.path.join(tmp, "ckpt")
            saved = os.path.join(tmp, "saved.bin")
            first, _ = self.launch(2, *COMMON, "--epochs", 1, "--fsdp", "--checkpoint_dir", ckpt, "--dump_params", saved)
            main = sorted(p for p in glob.glob(os.path.join(ckpt, "checkpoint_*.pt"))
                          if re.fullmatch(r"checkpoint_\d{10}\.pt", os.path.basename(p)))
            self.assertEqual(len(main), 1, os.listdir(ckpt))
            folder = main[0][:-3] + ".dcp"
            parts = sorted(f for f in os.listdir(folder) if f.endswith(".distcp"))
            self.assertEqual(parts, [f"__{r}_0.distcp" for r in range(2)], os.listdir(folder))
            # fc1's rows: each rank's part holds about half of the 1.6 MB of parameters (and SGD's
            # momentum for them), the main file none of fc1's.
            for s in parts:
                self.assertLess(os.path.getsize(os.path.join(folder, s)), 2 * 1.7e6 / 2 + 65536, s)
            self.assertLess(os.path.getsize(main[0]), 0.5e6, "the main file holds sharded rows")
            # The same folder resumed on 3 ranks first (a copy: the 2-rank resume below needs it). With
            # --epochs 1 the resumed run trains nothing: what it dumps is what it loaded, resharded.
            other = os.path.join(tmp, "other")
            shutil.copytree(ckpt, other)
            loaded = os.path.join(tmp, "loaded3.bin")
            res, _ = self.launch(3, *COMMON, "--epochs", 1, "--fsdp", "--checkpoint_dir", other, "--dump_params", loaded)
            self.assertIn("saved by 2 rank(s)", res.out)
            a, b = self.read(saved), self.read(loaded)
            self.assertEqual(len(a), len(b))
            differ = sum(1 for x, y in zip(a, b) if x != y)
            self.assertEqual(differ, 0, f"3 ranks resumed {differ} parameters other than the 2 ranks saved")
            # The epoch's line counts every step of the 2 ranks once (their running sums, gathered),
            # and so does a second resume of the checkpoint the 3 ranks wrote at the epoch's end, where
            # none of the epoch is left (it once printed Loss=-nan: 0 samples seen).
            epoch_line = re.compile(r"Epoch 1/1: (Loss=\S+, Acc=\S+, Test Acc=\S+)")
            want = epoch_line.search(first.out).group(1)
            self.assertEqual(epoch_line.search(res.out).group(1), want, res.out)
            res, _ = self.launch(3, *COMMON, "--epochs", 1, "--fsdp", "--checkpoint_dir", other)
            self.assertIn("resumed from", res.out)
            self.assertEqual(epoch_line.search(res.out).group(1), want, res.out)
            # Training on from the 2-rank checkpoint (a fresh copy: the run above saved again).
            again = os.path.join(tmp, "again")
            shutil.copytree(ckpt, again)
            res, _ = self.launch(3, *COMMON, "--epochs", 2, "--fsdp", "--checkpoint_dir", again)
            self.assertIn("saved by 2 rank(s)", res.out)
            self.assertIn("Epoch 2/2", res.out)
            res, resumed = self.launch(2, *COMMON, "--epochs", 2, "--fsdp", "--checkpoint_dir", ckpt)
            self.assertIn("resumed from", res.out)
            self.assertEqual(resumed.group(4), straight.group(4), "the resumed run differs from the straight one")

    def test_hsdp_mesh_ends_where_ddp_does(self):
        """--fsdp --fsdp_mesh 2,2 on 4 ranks (HSDP: sharded over pairs, replicated across them) ends
        where DDP does, within float32 rounding (its gradients are averaged in two steps, FSDP2's);
        a mesh that is not the world is refused in one line."""
        with tempfile.TemporaryDirectory() as tmp:
            ddp, hsdp = os.path.join(tmp, "ddp.bin"), os.path.join(tmp, "hsdp.bin")
            _, ddp_result = self.launch(4, *COMMON, "--epochs", 1, "--dump_params", ddp)
            res, hsdp_result = self.launch(4, *COMMON, "--epochs", 1, "--fsdp", "--fsdp_mesh", "2,2",
                                           "--dump_params", hsdp)
            self.assertIn("HSDP: replicate 2 x shard 2", res.out)
            a, b = self.read(ddp), self.read(hsdp)
            self.assertEqual(len(a), len(b))
            scale = max(abs(x) for x in a)
            worst = max(abs(x - y) for x, y in zip(a, b)) / scale
            self.assertLess(worst, 1e-5, "HSDP's parameters differ from DDP's")
            self.assertEqual(hsdp_result.group(2), ddp_result.group(2), "test accuracy differs from DDP's")
        res, _ = self.launch(2, *COMMON, "--fsdp", "--fsdp_mesh", "3,1", rc=1)
        self.assertIn("init_device_mesh: shape [3, 1] holds 3 ranks but the world has 2", res.err)

    def test_activation_checkpointing_changes_no_bit(self):
        """--activation_checkpoint recomputes the conv blocks in backward (dtrain::checkpoint): under DDP
        and under fully_shard the run ends with the very parameters of the run without it."""
        _, plain = self.launch(2, *COMMON, "--epochs", 1)
        for flags, line in ((("--activation_checkpoint", "full"), "activation checkpoint (conv blocks 1, 2)"),
                            (("--activation_checkpoint", "every:2", "--fsdp"), "activation checkpoint (conv block 1)")):
            with self.subTest(flags=flags):
                res, result = self.launch(2, *COMMON, "--epochs", 1, *flags)
                self.assertIn(line, res.out)
                self.assertEqual(result.group(4), plain.group(4), "params_sha256 differs from the run without it")
        res, _ = self.launch(2, *COMMON, "--activation_checkpoint", "every:0", rc=1)
        self.assertIn("give none, full or every:K with K >= 1, got 'every:0'", res.err)

    def test_ddp_only_flags_are_refused_with_fsdp(self):
        for args, text in ((("--fsdp", "--comm_hook", "bf16"), "--fsdp cannot be combined with --comm_hook bf16"),
                           (("--fsdp", "--uneven", 0.5), "--fsdp cannot be combined with --uneven"),
                           (("--reshard_after_forward", "false"), "--reshard_after_forward requires --fsdp")):
            with self.subTest(args=args):
                res, _ = self.launch(2, *COMMON, *args, rc=1)
                self.assertIn(text, res.err)


if __name__ == "__main__":
    unittest.main()
