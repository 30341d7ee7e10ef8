"""dtrain::SummaryWriter's files as TensorBoard itself reads them (the `tensorboard` package in .venv/,
installed by scripts/setup.sh): every value back as written, PyTorch's histograms, a truncated last
record, the TensorBoard server, and the trainer's --tensorboard.

TensorBoard lives in .venv/ while these tests run on the system's Python 3, so tensorboard_read.py
does the reading under $VENV_PYTHON and hands JSON back.

  TENSORBOARD_WRITE    the C++ program that writes the known values (tests/dist/tensorboard_write.cpp)
  VENV_PYTHON          a Python with tensorboard and torch
  TRAIN_FASHION_MNIST, DTRAIN_RUN   the trainer and the launcher
"""
import json
import math
import os
import re
import shutil
import struct
import subprocess
import tempfile
import unittest
import urllib.parse
import urllib.request

from harness import ROOT, HERE, DistTestCase, binary, clean_env, free_port, wait_until

VENV_PYTHON = os.environ.get("VENV_PYTHON", os.path.join(ROOT, ".venv", "bin", "python"))
READ = os.path.join(HERE, "tensorboard_read.py")


def setUpModule():
    if not os.access(VENV_PYTHON, os.X_OK):
        raise unittest.SkipTest(f"{VENV_PYTHON} does not exist: scripts/setup.sh makes .venv/ with tensorboard")
    probe = subprocess.run([VENV_PYTHON, "-c", "import tensorboard"], capture_output=True, text=True)
    if probe.returncode != 0:
        raise unittest.SkipTest(f"{VENV_PYTHON} cannot import tensorboard (scripts/setup.sh installs it): "
                                f"{probe.stderr.strip().splitlines()[-1:]}")


def tensorboard_read(mode, path):
    res = subprocess.run([VENV_PYTHON, READ, mode, path], capture_output=True, text=True, timeout=120,
                         env=clean_env(PYTHONDONTWRITEBYTECODE=1))
    if res.returncode != 0:
        raise AssertionError(f"tensorboard_read.py {mode} {path} failed:\n{res.stderr}")
    return json.loads(res.stdout)


def f32(x):
    """x rounded to float32, as simple_value stores it."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


def loss(step):  # tensorboard_write.cpp's loss(step), the same double arithmetic
    return (step * 7 % 13) / 3.0 + step * 0.001


def event_files(folder):
    return sorted(f for f in os.listdir(folder) if f.startswith("events.out.tfevents."))


class Written:
    """tensorboard_write's output, made once for the whole file."""
    dir = None

    @classmethod
    def get(cls):
        if cls.dir is None:
            writer = binary("TENSORBOARD_WRITE", "tensorboard_write")
            if not writer:
                raise unittest.SkipTest("tensorboard_write is not built (set TENSORBOARD_WRITE)")
            cls.dir = tempfile.mkdtemp(prefix="dtrain_tb_")
            subprocess.run([writer, os.path.join(cls.dir, "logs"), os.path.join(cls.dir, "values")], check=True,
                           capture_output=True, timeout=60)
        return os.path.join(cls.dir, "logs"), os.path.join(cls.dir, "values")


def tearDownModule():
    if Written.dir:
        shutil.rmtree(Written.dir, ignore_errors=True)


class SummaryWriterFiles(DistTestCase):
    def test_every_value_comes_back_as_written(self):
        logs, _ = Written.get()
        runs = tensorboard_read("runs", logs)
        self.assertEqual(sorted(runs), [".", "ranks_step_ms_max", "ranks_step_ms_min"])
        main = runs["."]
        self.assertEqual(main["file_version"], 2.0)  # TensorBoard parses "brain.Event:2"
        got = main["scalars"]["loss"]
        self.assertEqual([s for _, s, _ in got], list(range(100)))
        self.assertEqual([v for _, _, v in got], [f32(loss(s)) for s in range(100)])  # float32, bit for bit
        (wall, step, value), = main["scalars"]["walltime"]
        self.assertEqual((wall, step, value), (1234567890.25, 3, 1.5))
        self.assertEqual(main["scalars"]["last"][0][1:], [7, 42.0])
        # add_scalars: each tag in its own run, main_tag as the tag, one wall time per call.
        for tag, fn in (("min", lambda s: s * 0.5), ("max", lambda s: s * 1.25 + 0.1)):
            got = runs["ranks_step_ms_" + tag]["scalars"]
            self.assertEqual(list(got), ["ranks/step_ms"])
            self.assertEqual([(s, v) for _, s, v in got["ranks/step_ms"]], [(s, f32(fn(s))) for s in range(10)])
        self.assertEqual([w for w, _, _ in runs["ranks_step_ms_min"]["scalars"]["ranks/step_ms"]],
                         [w for w, _, _ in runs["ranks_step_ms_max"]["scalars"]["ranks/step_ms"]])
        # Text as PyTorch writes it: the text plugin's string tensor of shape [1].
        (text,) = main["tensors"]["notes/text_summary"]
        self.assertEqual(text, {"step": 2, "plugin": "text", "dtype": 7, "shape": [1],
                                "strings": ["**dtrain** says hello: \u00e4\u00f6\u00fc"]})

    def test_histograms_equal_pytorchs(self):
        logs, values = Written.get()
        main = tensorboard_read("runs", logs)["."]["histograms"]
        reference = tensorboard_read("reference", values)
        self.assertEqual(len(reference.pop("_bins")), 1549)
        self.assertEqual(sorted(main), ["constant", "huge", "ints", "normal", "tiny_and_zero"])
        cases = [(tag, 0, tag) for tag in main] + [("normal", 1, "normal_step6")]
        for tag, i, ref_name in cases:
            with self.subTest(tag=tag, step=5 + i):
                got, ref = dict(main[tag][i]), reference[ref_name]
                self.assertEqual(got.pop("step"), 5 + i)
                for key in ("min", "max", "num", "bucket_limit", "bucket"):
                    self.assertEqual(got[key], ref[key], key)
                for key in ("sum", "sum_squares"):  # numpy sums pairwise, LibTorch in its own order
                    self.assertTrue(math.isclose(got[key], ref[key], rel_tol=1e-12, abs_tol=1e-300),
                                    f"{key}: {got[key]} vs {ref[key]}")
        normal = main["normal"][0]
        self.assertEqual(normal["num"], 1000)
        self.assertEqual(sum(normal["bucket"]), 1000)
        huge = main["huge"][0]
        self.assertEqual((huge["max"], sum(huge["bucket"])), (1e25, 3))  # 1e25 is past the last edge

    def test_every_record_has_both_checksums(self):
        logs, _ = Written.get()
        for folder in (logs, os.path.join(logs, "ranks_step_ms_min")):
            (name,) = event_files(folder)
            self.assertRegex(name, r"^events\.out\.tfevents\.\d{10}\.[^.]+(\.[^.]+)*\.\d+\.\d+$")
            recs = tensorboard_read("records", os.path.join(folder, name))
            self.assertEqual(recs["end"], recs["size"], "bytes after the last record")
            self.assertTrue(all(r["length_crc_ok"] and r["data_crc_ok"] for r in recs["records"]), recs)

    def test_truncated_last_record_is_skipped_and_earlier_ones_kept(self):
        logs, _ = Written.get()
        (name,) = event_files(logs)
        recs = tensorboard_read("records", os.path.join(logs, name))["records"]
        last = recs[-1]
        with tempfile.TemporaryDirectory() as cut:
            for keep in (last["offset"] + 12 + last["length"] // 2, last["offset"] + 5):  # mid-data, mid-header
                with self.subTest(bytes=keep):
                    with open(os.path.join(logs, name), "rb") as f:
                        data = f.read(keep)
                    with open(os.path.join(cut, name), "wb") as f:
                        f.write(data)
                    main = tensorboard_read("runs", cut)["."]
                    self.assertNotIn("last", main["scalars"])  # the cut record ...
                    self.assertEqual(len(main["scalars"]["loss"]), 100)  # ... and nothing before it lost
                    self.assertIn("walltime", main["scalars"])
                    self.assertEqual(len(main["histograms"]["normal"]), 2)
                    self.assertIn("notes/text_summary", main["tensors"])


class TensorBoardServer(DistTestCase):
    def test_scalars_endpoint_serves_the_run(self):
        logs, _ = Written.get()
        port = free_port()
        server = self.spawn([os.path.join(os.path.dirname(VENV_PYTHON), "tensorboard"), "--logdir", logs,
                             "--host", "127.0.0.1", "--port", port, "--load_fast", "false", "--reload_interval", "1"],
                            clean_env(PYTHONDONTWRITEBYTECODE=1))
        base = f"http://127.0.0.1:{port}"

        def get(path):
            with urllib.request.urlopen(base + path, timeout=5) as r:
                return json.loads(r.read().decode())

        def loaded():
            try:
                return "loss" in get("/data/plugin/scalars/tags").get(".", {})
            except OSError:
                return server.ended()  # stop waiting if it died
        if not (wait_until(loaded, timeout=90, step=0.5) and not server.ended()):
            self.fail(f"TensorBoard did not serve the run within 90 s:\n{server.finish(1)}")
        runs = get("/data/runs")
        self.assertEqual(sorted(runs), [".", "ranks_step_ms_max", "ranks_step_ms_min"])
        query = urllib.parse.urlencode({"run": ".", "tag": "loss"})
        points = get("/data/plugin/scalars/scalars?" + query)  # [[wall_time, step, value], ...]
        self.assertEqual([(s, v) for _, s, v in points], [(s, f32(loss(s))) for s in range(100)])
        query = urllib.parse.urlencode({"run": "ranks_step_ms_max", "tag": "ranks/step_ms"})
        self.assertEqual([v for _, _, v in get("/data/plugin/scalars/scalars?" + query)],
                         [f32(s * 1.25 + 0.1) for s in range(10)])
        # The text and histogram dashboards read the other two kinds of record.
        query = urllib.parse.urlencode({"run": ".", "tag": "notes/text_summary"})
        (text,) = get("/data/plugin/text/text?" + query)
        self.assertEqual(text["step"], 2)
        self.assertIn("<strong>dtrain</strong> says hello: \u00e4\u00f6\u00fc", text["text"])
        query = urllib.parse.urlencode({"run": ".", "tag": "normal"})
        self.assertEqual([h[1] for h in get("/data/plugin/histograms/histograms?" + query)], [5, 6])
        server.p.terminate()
        try:
            server.p.wait(timeout=15)
        except subprocess.TimeoutExpired:
            server.kill()
        self.assertIsNotNone(server.p.returncode)


class TrainerTensorBoard(DistTestCase):
    def trainer_run(self, *args, timeout=150):
        trainer = binary("TRAIN_FASHION_MNIST", "train_fashion_mnist")
        launcher = binary("DTRAIN_RUN", "dtrain-run")
        if not trainer or not launcher:
            raise unittest.SkipTest("train_fashion_mnist or dtrain-run is not built")
        return self.run_one([launcher, "--standalone", "--nproc_per_node", 2, "--grace_period", 2, trainer, *args],
                            clean_env(DTRAIN_TIMEOUT_S=60), timeout=timeout)

    def test_trainer_writes_what_the_monitor_gathers(self):
        with tempfile.TemporaryDirectory() as out:
            # 3200 samples / (2 ranks x 32) = 50 steps per epoch: windows (log_every 50) end at 50 and 100.
            res = self.trainer_run("--subset", 3200, "--test_subset", 640, "--epochs", 2, "--checkpoint_dir", out,
                                   "--tensorboard")
            self.assertEqual(res.rc, 0, str(res))
            m = re.search(r"RESULT epochs=2 test_accuracy=([0-9.]+) train_loss=([0-9.]+)", res.out)
            self.assertIsNotNone(m, str(res))
            runs = tensorboard_read("runs", out)
            with open(os.path.join(out, "metrics.jsonl")) as f:
                windows = [json.loads(line) for line in f]
        self.assertEqual([w["step"] for w in windows], [50, 100])
        main = runs["."]["scalars"]
        for tag, field in (("train/loss", "loss"), ("train/accuracy", "accuracy"),
                           ("train/samples_per_s", "samples_per_s"), ("time_ms/step", ("step_ms", "mean")),
                           ("time_ms/comm", ("comm_ms", "mean")), ("time_ms/comm_wait", ("comm_wait_ms", "mean")),
                           ("time_ms/forward", ("forward_ms", "mean")), ("ranks/slowest_rank", "slowest_rank")):
            with self.subTest(tag=tag):
                expected = [w[field] if isinstance(field, str) else w[field[0]][field[1]] for w in windows]
                got = main[tag]
                self.assertEqual([s for _, s, _ in got], [50, 100])
                for v, e in zip((v for _, _, v in got), expected):  # metrics.jsonl prints a few digits
                    self.assertTrue(math.isclose(v, e, rel_tol=1e-3, abs_tol=1e-3), f"{v} vs {e}")
        for name in ("step", "forward", "backward", "optimizer", "comm", "comm_wait", "other"):
            lo = runs[f"ranks_{name}_ms_min"]["scalars"][f"ranks/{name}_ms"]
            hi = runs[f"ranks_{name}_ms_max"]["scalars"][f"ranks/{name}_ms"]
            self.assertEqual([s for _, s, _ in lo], [50, 100])
            self.assertTrue(all(a[2] <= b[2] for a, b in zip(lo, hi)), (name, lo, hi))
        # Per epoch: the values the trainer printed (4 decimals) at steps 1 and 2.
        self.assertEqual([s for _, s, _ in main["epoch/test_accuracy"]], [1, 2])
        self.assertAlmostEqual(main["epoch/test_accuracy"][-1][2], float(m.group(1)), delta=6e-5)
        self.assertAlmostEqual(main["epoch/train_loss"][-1][2], float(m.group(2)), delta=6e-5)
        self.assertEqual([s for _, s, _ in main["epoch/train_accuracy"]], [1, 2])
        # Histograms in the first window (histogram_every 10): every parameter and its gradient.
        hist = runs["."]["histograms"]
        params = sorted(t for t in hist if t.startswith("parameters/"))
        self.assertGreaterEqual(len(params), 4, sorted(hist))
        for tag in params:
            grad = hist["gradients/" + tag[len("parameters/"):]]
            self.assertEqual([h["step"] for h in hist[tag]], [50])
            self.assertEqual([h["step"] for h in grad], [50])
            self.assertEqual(sum(hist[tag][0]["bucket"]), hist[tag][0]["num"])

    def test_tensorboard_without_an_output_folder_is_refused(self):
        res = self.trainer_run("--subset", 64, "--epochs", 1, "--tensorboard", timeout=60)
        self.assertNotEqual(res.rc, 0, str(res))
        self.assertIn("--tensorboard requires --checkpoint_dir", res.out + res.err)


if __name__ == "__main__":
    unittest.main()
