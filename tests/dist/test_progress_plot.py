"""examples/train_fashion_mnist under dtrain-run, as a user sees it: the progress bar on a terminal
and plot.svg in a browser.

  * on a pseudo-terminal, rank 0's bar is one line updated in place (several states in the capture,
    one line on the final screen), with its [rank 0] prefix; through a pipe, plain lines and no '\r';
  * plot.svg of a 47-step run (one metrics window) and of a 2-epoch run, rendered by headless
    Chromium: every panel holds pixels of each of its series' colours inside its frame, not only
    the frame (the 47-step plot used to be three empty frames); the x axis spans the steps run.

Binaries: $TRAIN_FASHION_MNIST and $DTRAIN_RUN (set by tests/dist/CMakeLists.txt), else build*/bin.
"""
import json
import os
import re
import sys
import tempfile
import unittest

from harness import DistTestCase, clean_env, launcher, trainer

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "common"))
import svg_screenshot  # noqa: E402
from pty_screen import Screen, run_on_pty  # noqa: E402

RUN_TIMEOUT_S = 150
BAR_RE = re.compile(r"^\[rank 0\] epoch 1/1 \[(=*)>? *\] +(\d+)% (\d+)/47 loss ")
# src/monitor/run_plot.cpp's colours, per panel: the series a run always has.
COLOURS = {"loss": {"train": "#1f77b4"},
           "accuracy": {"train": "#2ca02c", "test (epoch)": "#d62728"},
           "throughput": {"samples/s": "#9467bd"}}
SPLIT_COLOURS = {"compute": "#17becf", "communication hidden": "#ff7f0e", "communication waited": "#d62728"}


def train_args(ckpt, epochs, *extra):
    # 3000 samples, 2 ranks x batch 32: 47 steps per epoch; a small test set keeps evaluation short.
    return [launcher(), "--standalone", "--nproc_per_node", 2, "--grace_period", 2, trainer(), "--subset", 3000,
            "--test_subset", 1000, "--epochs", epochs, "--checkpoint_dir", ckpt, *extra]


class ProgressAndPlot(DistTestCase):
    def check_plot(self, ckpt, steps, epochs):
        with open(os.path.join(ckpt, "plot.svg")) as f:
            svg = f.read()
        self.assertIn(f"training: {steps} steps on 2 rank(s)", svg)
        self.assertIn('text-anchor="middle">0</text>', svg, "the x axis starts at step 0")
        with open(os.path.join(ckpt, "metrics.jsonl")) as f:
            windows = [json.loads(l) for l in f]
        why = svg_screenshot.missing()
        if why:
            self.skipTest(why)
        img = svg_screenshot.screenshot(os.path.join(ckpt, "plot.svg"))
        found = svg_screenshot.panels(svg)
        self.assertEqual([t.split(" ")[0] for t, _ in found], ["loss", "accuracy", "throughput", "step"], svg[:400])
        for title, rect in found:
            key = title.split(" ")[0]
            colours = dict(COLOURS.get(key, {}))
            if key == "step":
                # Note [Step split]: a band shows when it is at least 2 px high on the axis's scale.
                top = max(w["step_ms"]["mean"] for w in windows)
                for name, colour in SPLIT_COLOURS.items():
                    values = {"compute": [w["step_ms"]["mean"] - max(w["comm_ms"]["mean"], w["comm_wait_ms"]["mean"])
                                          for w in windows],
                              "communication hidden": [w["comm_ms"]["mean"] - w["comm_wait_ms"]["mean"] for w in windows],
                              "communication waited": [w["comm_wait_ms"]["mean"] for w in windows]}[name]
                    if max(values) / (top * 2) * rect[3] >= 2:
                        colours[name] = colour
                self.assertIn("compute", colours)
            for name, colour in colours.items():
                n = svg_screenshot.count_pixels(img, rect, colour)
                self.assertGreaterEqual(n, 10, f"panel '{title}': no pixels of {name} ({colour}) inside its frame")
        return svg, windows

    def test_bar_on_a_terminal_and_the_plot_of_47_steps(self):
        with tempfile.TemporaryDirectory() as ckpt:
            # --step_sleep_ms: the run lasts a few of the bar's 200 ms redraw periods.
            rc, raw = run_on_pty(train_args(ckpt, 1, "--step_sleep_ms", 25), clean_env(DTRAIN_TIMEOUT_S=60),
                                 timeout=RUN_TIMEOUT_S)
            text = raw.decode(errors="replace")
            self.assertEqual(rc, 0, text[-3000:])
            screen = Screen(raw).text()
            shown = "\n".join(screen)
            bars = [l for l in screen if BAR_RE.match(l)]
            self.assertEqual(len(bars), 1, f"one bar line on the final screen:\n{shown}")
            self.assertIn("100% 47/47", bars[0])
            self.assertNotIn(" 10% ", shown, "no plain progress lines on a terminal")
            states = set(re.findall(r"\[rank 0\] epoch 1/1 \[[=> ]*\] +(\d+)% ", text))
            self.assertGreaterEqual(len(states), 3, f"the bar was redrawn in place: {sorted(states)}")
            self.assertTrue(any(l.startswith("[rank 0] Epoch 1/1: Loss=") for l in screen), shown)
            self.assertTrue(screen[-1].startswith("[rank 0] RESULT "), shown)
            svg, windows = self.check_plot(ckpt, 47, 1)
            self.assertEqual([w["step"] for w in windows], [47])

    def test_plain_lines_in_a_pipe_and_the_plot_of_two_epochs(self):
        with tempfile.TemporaryDirectory() as ckpt:
            res = self.run_one(train_args(ckpt, 2), clean_env(DTRAIN_TIMEOUT_S=60), timeout=RUN_TIMEOUT_S)
            self.assertEqual(res.rc, 0, str(res))
            self.assertNotIn("\r", res.out)
            for epoch in (1, 2):
                plain = [l for l in res.out.splitlines() if l.startswith(f"[rank 0] epoch {epoch}/2 ")]
                self.assertEqual(len(plain), 10, f"a line per 10% of epoch {epoch}:\n{res}")
            svg, windows = self.check_plot(ckpt, 94, 2)
            self.assertEqual([w["step"] for w in windows], [50, 94])
            self.assertEqual(svg.count('r="6"'), 2 + 2 + 2, "rings: train loss, train and test accuracy x 2 epochs")


if __name__ == "__main__":
    unittest.main()
