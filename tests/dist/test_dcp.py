"""PyTorch's distributed checkpoint format both ways, against .venv's PyTorch 2.x (CPU, Gloo):
dtrain::dcp on 3 ranks (DDP, DDP with a ZeroRedundancyOptimizer, fully_shard, tensor parallelism;
Adam, float64) saves, and Python's dcp.load on 1 and on 2 ranks reads the very parameters dtrain had
(bit for bit) and trains on to within 1e-10 of dtrain's own continued training; the tensor-parallel
save loads back into dtrain's TP and unsharded (DDP) models alike; Python's dcp.save on 2 ranks loads
into dtrain on 3 the same way; TP inside fully_shard saved by dtrain on a {dp 2, tp 2} mesh loads into
PyTorch's model parallelized alike, bit for bit; so does HSDP saved by dtrain on a {replicate 2, shard 2} mesh
into PyTorch's own 2-D fully_shard. Bad folders (a flipped byte of a tensor, truncated, corrupt, missing
metadata, a chunk of the wrong rank, a FIFO or a link in place of a file) fail in one line.

Env: $DCP_INTEROP (the C++ program, dcp_interop.cpp), $VENV_PYTHON (set by tests/dist/CMakeLists.txt).
"""
import json
import os
import shutil
import struct
import subprocess
import tempfile
import unittest

from harness import DistTestCase, binary

HERE = os.path.dirname(os.path.abspath(__file__))
VENV_PYTHON = os.environ.get("VENV_PYTHON", "")


class DcpAgainstPytorch(DistTestCase):
    def setUp(self):
        if not VENV_PYTHON or not os.access(VENV_PYTHON, os.X_OK):
            raise unittest.SkipTest(f".venv's python is missing ({VENV_PYTHON!r}): run scripts/setup.sh")
        self.cxx = binary("DCP_INTEROP", "dcp_interop")
        self.tmp = tempfile.mkdtemp(prefix="dtrain_dcp_")
        self.addCleanup(shutil.rmtree, self.tmp, True)

    def ranks(self, argv, world, out, expect_ok=True):
        """argv on `world` ranks (env://); rank 0's JSON, or the ranks' results when they may fail."""
        return self.run_ranks_json(argv, world, out, timeout=180, expect_ok=expect_ok, DTRAIN_TIMEOUT_S=60)

    def dtrain(self, mode, kinds, folder, world=3, **kw):
        return self.ranks([self.cxx, mode, ",".join(kinds), folder], world,
                          os.path.join(self.tmp, f"cxx_{mode}_{os.path.basename(folder)}.json"), **kw)

    def python(self, mode, folders, world):
        out = os.path.join(self.tmp, f"py_{mode}_{world}.json")
        return self.ranks([VENV_PYTHON, os.path.join(HERE, "dcp_interop.py"), mode, ",".join(folders)], world, out)

    def assert_close(self, mine, ref, what, tol=1e-10):
        self.assertEqual(sorted(mine), sorted(ref), what)
        for name, values in ref.items():
            scale = max(max(abs(v) for v in values), 1e-6)
            worst = max(abs(a - b) for a, b in zip(mine[name], values)) / scale
            self.assertLess(worst, tol, f"{what} {name}: relative difference {worst:.3g}")

    def metadata(self, *folders):
        """Each folder's .metadata as PyTorch reads it; one process for all (unpickling imports torch,
        seconds of CPU each time). One folder: its metadata; several: a list of them."""
        code = ("import pickle, sys, json\n"
                "def read(f):\n"
                "    m = pickle.load(open(f + '/.metadata', 'rb'))\n"
                "    return {'chunks': {k: [list(c.offsets) for c in v.chunks] for k, v in "
                "m.state_dict_metadata.items() if hasattr(v, 'chunks')}, 'items': [[i.fqn, s.relative_path, "
                "s.offset, s.length] for i, s in m.storage_data.items()]}\n"
                "print(json.dumps([read(f) for f in sys.argv[1:]]))")
        metas = json.loads(subprocess.check_output([VENV_PYTHON, "-c", code, *folders], text=True))
        return metas[0] if len(folders) == 1 else metas

    def check_layout(self, folder, kind, meta):
        files = sorted(f for f in os.listdir(folder) if f.endswith(".distcp"))
        # Each rank wrote its own file (3 ranks share the replicated items), and the files hold exactly
        # the items: nothing written twice, nothing stray.
        self.assertEqual(files, ["__0_0.distcp", "__1_0.distcp", "__2_0.distcp"], kind)
        for name in files:
            spans = sorted((off, length) for _, path, off, length in meta["items"] if path == name)
            end = 0
            for off, length in spans:
                self.assertEqual(off, end, f"{kind} {name}: a gap or an overlap at byte {off}")
                end = off + length
            self.assertEqual(os.path.getsize(os.path.join(folder, name)), end, f"{kind} {name}")
        self.assertEqual(len({(fqn, path, off) for fqn, path, off, _ in meta["items"]}), len(meta["items"]))
        # fully_shard: each weight in the rows of its 3 ranks (13 rows: 5, 5, 3), as FSDP2's chunks;
        # tensor parallelism: the Colwise weight likewise (DTensor's Shard(0)), the Rowwise one in
        # columns (Shard(1)), its bias whole.
        expected = [[0, 0], [5, 0], [10, 0]] if kind in ("fsdp", "tp") else [[0, 0]]
        self.assertEqual(sorted(meta["chunks"]["model.0.weight"]), expected, kind)
        self.assertEqual(sorted(meta["chunks"]["optim.state.0.weight.exp_avg"]), expected, kind)
        if kind == "tp":
            for key in ("model.2.weight", "optim.state.2.weight.exp_avg_sq"):
                self.assertEqual(sorted(meta["chunks"][key]), [[0, 0], [0, 5], [0, 10]], key)
            self.assertEqual(meta["chunks"]["model.2.bias"], [[0]], "replicated: one whole chunk")

    def test_dtrain_saves_and_python_loads_on_1_and_2_ranks(self):
        kinds = ("ddp", "zero", "fsdp", "tp")
        cxx = self.dtrain("save", kinds, self.tmp)
        folders = [os.path.join(self.tmp, kind) for kind in kinds]
        for kind, folder, meta in zip(kinds, folders, self.metadata(*folders)):
            self.check_layout(folder, kind, meta)
        for world in (1, 2):
            py = self.python("load", folders, world)
            for kind, folder in zip(kinds, folders):
                self.assertEqual(py[folder]["at_checkpoint"], cxx[kind]["at_checkpoint"], f"{kind}: loaded on {world}")
                self.assert_close(py[folder]["after"], cxx[kind]["after"], f"{kind}: trained on after loading on {world}")
        # dtrain reads its tensor-parallel save back, into the TP model and into the unsharded one.
        back = self.dtrain("load", ("tp", "ddp"), os.path.join(self.tmp, "tp"))
        for kind in ("tp", "ddp"):
            self.assertEqual(back[kind]["at_checkpoint"], cxx["tp"]["at_checkpoint"], f"tp loaded into {kind}")
            self.assert_close(back[kind]["after"], cxx["tp"]["after"], f"tp loaded into {kind}, trained on")

    def test_2d_dtrain_saves_and_python_loads_into_its_2d_model(self):
        """TP inside fully_shard on a {dp 2, tp 2} mesh of 4 ranks: each rank's chunk is its box, TP's
        offset plus fully_shard's within TP's part, and PyTorch's model parallelized alike
        (parallelize_module on mesh["tp"], then fully_shard on mesh["dp"]) loads the very whole
        parameters and trains on as dtrain does; so does it from CheckpointManager's checkpoint of it."""
        cxx = self.dtrain("save_ckpt", ["2d"], self.tmp, world=4)["2d"]
        folder = os.path.join(self.tmp, "2d")
        chunks = self.metadata(folder)["chunks"]
        # 13 hidden features: tp parts of 7 and 6, cut by dp into 4 + 3 and 3 + 3 rows (Colwise), the
        # Rowwise weight's 5 rows into 3 + 2 in each tp part's columns
        self.assertEqual(sorted(chunks["model.0.weight"]), [[0, 0], [4, 0], [7, 0], [10, 0]])
        self.assertEqual(sorted(chunks["optim.state.0.weight.exp_avg"]), [[0, 0], [4, 0], [7, 0], [10, 0]])
        self.assertEqual(sorted(chunks["model.2.weight"]), [[0, 0], [0, 7], [3, 0], [3, 7]])
        # CheckpointManager's checkpoint of the same model: its DCP folder is read alike.
        managed = os.path.join(self.tmp, "2d_ckpt", "checkpoint_0000000003.dcp")
        py = self.python("load2d", [folder, managed], 4)
        for f in (folder, managed):
            self.assertEqual(py[f]["at_checkpoint"], cxx["at_checkpoint"], f"2d: {f} loaded into PyTorch's 2-D model")
            self.assert_close(py[f]["after"], cxx["after"], f"2d: {f} trained on after loading")

    def test_hsdp_dtrain_saves_and_python_loads_into_its_hsdp_model(self):
        """HSDP on a {replicate 2, shard 2} mesh of 4 ranks: the replicas hold the same rows, so the
        folder holds each shard group's chunk once; PyTorch's fully_shard on its own (replicate, shard)
        mesh loads the very whole parameters and trains on as dtrain does; so does it from
        CheckpointManager's checkpoint of it."""
        cxx = self.dtrain("save_ckpt", ["hsdp"], self.tmp, world=4)["hsdp"]
        folder = os.path.join(self.tmp, "hsdp")
        meta = self.metadata(folder)
        # 13 rows over the shard group of 2: 7 + 6, as FSDP2's chunks, each once (not per replica).
        self.assertEqual(sorted(meta["chunks"]["model.0.weight"]), [[0, 0], [7, 0]])
        self.assertEqual(sorted(meta["chunks"]["optim.state.0.weight.exp_avg"]), [[0, 0], [7, 0]])
        self.assertEqual(sorted(meta["chunks"]["model.4.weight"]), [[0, 0], [2, 0]])
        managed = os.path.join(self.tmp, "hsdp_ckpt", "checkpoint_0000000003.dcp")
        py = self.python("loadhsdp", [folder, managed], 4)
        for f in (folder, managed):
            self.assertEqual(py[f]["at_checkpoint"], cxx["at_checkpoint"], f"hsdp: {f} loaded into PyTorch's HSDP")
            self.assert_close(py[f]["after"], cxx["after"], f"hsdp: {f} trained on after loading")

    def test_python_saves_on_2_ranks_and_dtrain_loads_on_3(self):
        folder = os.path.join(self.tmp, "from_python")
        py = self.python("save", [folder], 2)[folder]
        cxx = self.dtrain("load", ("ddp", "zero", "fsdp", "tp"), folder)
        for kind, mine in cxx.items():
            self.assertEqual(mine["at_checkpoint"], py["at_checkpoint"], kind)
            self.assert_close(mine["after"], py["after"], f"{kind}: trained on after loading")

    def test_a_damaged_folder_fails_in_one_line_on_every_rank(self):
        self.dtrain("save", ["ddp"], self.tmp)
        folder = os.path.join(self.tmp, "ddp")

        def damaged(name, change):
            bad = os.path.join(self.tmp, name)
            shutil.copytree(folder, bad)
            change(bad)
            return bad

        def truncate(path):
            with open(path, "r+b") as f:
                f.truncate(os.path.getsize(path) // 2)

        def scribble(path):
            with open(path, "r+b") as f:
                f.seek(40)
                f.write(b"\xff" * 16)

        def flip_tensor_byte(path):
            """One bit of a tensor's data: the first byte of the first record named .../data/N of an
            item. torch.save writes sizes after the data (a data descriptor), so the record's data
            runs from its local header to the next header less the 16-byte descriptor."""
            with open(path, "r+b") as f:
                blob = f.read()
                at = blob.index(b"PK\x03\x04")
                while True:
                    name_len, extra_len = struct.unpack_from("<HH", blob, at + 26)
                    name = blob[at + 30:at + 30 + name_len]
                    data = at + 30 + name_len + extra_len
                    following = blob.index(b"PK", data)
                    if b"/data/" in name and following - 16 > data:
                        f.seek(data)
                        f.write(bytes([blob[data] ^ 0x40]))
                        return
                    at = blob.index(b"PK\x03\x04", at + 4)

        def edit_metadata(folder, code):
            """Runs `code` on the folder's metadata `m` (Python's dataclasses), then writes it back."""
            prog = ("import pickle, sys, torch\nm = pickle.load(open(sys.argv[1], 'rb'))\n" + code +
                    "\npickle.dump(m, open(sys.argv[1], 'wb'))\n")
            subprocess.run([VENV_PYTHON, "-c", prog, os.path.join(folder, ".metadata")], check=True, timeout=120)

        def replace_with_fifo(path):
            os.remove(path)
            os.mkfifo(path)

        def replace_with_link(path):
            """A link to a good copy outside the folder: a load reads only the folder's own files."""
            outside = os.path.join(self.tmp, "outside_" + os.path.basename(path))
            shutil.move(path, outside)
            os.symlink(outside, path)

        cases = {
            # A byte of a tensor's data changed: LibTorch's zip reader does not check the CRC-32, so
            # without dtrain's own check this loads a wrong number silently (PyTorch's dcp.load does).
            "flipped": (lambda d: flip_tensor_byte(os.path.join(d, "__1_0.distcp")), "is damaged (the zip entry"),
            "truncated": (lambda d: truncate(os.path.join(d, "__1_0.distcp")), "is truncated"),
            "no_metadata": (lambda d: os.remove(os.path.join(d, ".metadata")), "is missing"),
            "bad_metadata": (lambda d: scribble(os.path.join(d, ".metadata")), ".metadata: "),
            "short_metadata": (lambda d: truncate(os.path.join(d, ".metadata")), "truncated pickle"),
            # A chunk of fewer dimensions than its tensor: the planner read offsets that are not
            # there (a segfault).
            "rankless_chunk": (lambda d: edit_metadata(d, "m.state_dict_metadata['model.0.weight'].chunks[0].offsets"
                                                          " = torch.Size(())"),
                               "state_dict_metadata['model.0.weight'].chunks[0] has offsets [] and sizes [13, 8]"),
            # A FIFO in place of a file: open() waited for a writer that never came (the load hung).
            "fifo": (lambda d: replace_with_fifo(os.path.join(d, "__1_0.distcp")), "__1_0.distcp is a FIFO"),
            "fifo_metadata": (lambda d: replace_with_fifo(os.path.join(d, ".metadata")), ".metadata is a FIFO"),
            "link": (lambda d: replace_with_link(os.path.join(d, "__1_0.distcp")), "__1_0.distcp is a symbolic link"),
            "link_metadata": (lambda d: replace_with_link(os.path.join(d, ".metadata")), ".metadata is a symbolic link"),
        }
        for name, (change, words) in cases.items():
            with self.subTest(case=name):
                results = self.dtrain("load", ["ddp"], damaged(name, change), expect_ok=False)
                for r, res in enumerate(results):
                    self.assertEqual(res.rc, 1, f"rank {r}: {res}")
                    lines = [l for l in res.err.splitlines() if "dcp_interop: error:" in l]
                    self.assertEqual(len(lines), 1, res.err)
                    self.assertIn("dcp::load: rank", lines[0])
                    self.assertIn(words, lines[0])

    def test_a_rank_that_cannot_write_fails_the_save_on_every_rank_and_leaves_no_metadata(self):
        """dcp.h's promises for a failed save: rank 0 removes the old .metadata first, .metadata is
        written last (so never beside a missing item), and any rank's failure throws on every rank."""
        self.dtrain("save", ["ddp"], self.tmp)
        folder = os.path.join(self.tmp, "ddp")
        self.assertTrue(os.path.exists(os.path.join(folder, ".metadata")), os.listdir(folder))
        # Rank 1's file cannot be replaced: a folder stands at its name (root ignores file modes).
        os.remove(os.path.join(folder, "__1_0.distcp"))
        os.mkdir(os.path.join(folder, "__1_0.distcp"))
        results = self.dtrain("save", ["ddp"], self.tmp, expect_ok=False)
        lines = []
        for r, res in enumerate(results):
            self.assertEqual(res.rc, 1, f"rank {r}: {res}")
            mine = [l for l in res.err.splitlines() if "dcp_interop: error:" in l]
            self.assertEqual(len(mine), 1, res.err)
            lines.append(mine[0])
        self.assertIn("rank 1", lines[0])
        self.assertIn("__1_0.distcp", lines[0])
        self.assertEqual(len(set(lines)), 1, f"the ranks threw different lines: {lines}")
        self.assertFalse(os.path.exists(os.path.join(folder, ".metadata")),
                         f"a failed save left .metadata: {os.listdir(folder)}")
        # PyTorch's reader refuses the folder too (no .metadata: nothing claims it is a checkpoint);
        # its CheckpointException is a BaseException.
        probe = ("import sys, torch, torch.distributed.checkpoint as dcp\n"
                 "try:\n    dcp.load({'x': torch.zeros(1)}, checkpoint_id=sys.argv[1])\n"
                 "except BaseException as e:\n    print(type(e).__name__); sys.exit(3)\n")
        py = subprocess.run([VENV_PYTHON, "-c", probe, folder], capture_output=True, text=True, timeout=120)
        self.assertEqual(py.returncode, 3, f"Python's dcp.load accepted the folder:\n{py.stdout}{py.stderr}")


if __name__ == "__main__":
    unittest.main()
