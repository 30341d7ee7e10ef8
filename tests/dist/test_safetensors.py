"""safetensors both ways against PyPI's `safetensors` (in .venv): a file Python's save_file wrote, with
a tensor of every dtype both know, read by dtrain and written back (safetensors_tool.cpp), reads in
Python's load_file bit-identical, metadata included; dtrain's own layout is Python's (every tensor
aligned); and damaged files are refused in one line naming the file and the byte offset.

Env: $SAFETENSORS_TOOL (the C++ program), $VENV_PYTHON (set by tests/dist/CMakeLists.txt).
"""
import json
import os
import shutil
import subprocess
import tempfile
import unittest

from harness import binary

VENV_PYTHON = os.environ.get("VENV_PYTHON", "")

WRITE = r"""
import sys, torch
from safetensors.torch import save_file
g = torch.Generator().manual_seed(7)
dtypes = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
          torch.bfloat16, torch.float32, torch.float64, torch.complex64]
if sys.argv[2] == "2":  # LibTorch 2.x: float8 and the wide unsigned integers too
    dtypes += [torch.float8_e4m3fn, torch.float8_e5m2, torch.uint16, torch.uint32, torch.uint64]
tensors = {}
for k, dt in enumerate(dtypes):
    raw = torch.randint(0, 256, (3 * 5 * 8,), dtype=torch.uint8, generator=g)
    t = raw.view(dt) if dt.itemsize == 1 else raw[: 3 * 5 * dt.itemsize * 2].view(dt)
    if dt == torch.bool:
        t = raw[:15] % 2 == 1
    tensors[f"t{k}_{str(dt).split('.')[1]}"] = t.reshape(3, -1).clone()
tensors["scalar"] = torch.tensor(3.5)
tensors["empty"] = torch.zeros(0, 4)
save_file(tensors, sys.argv[1], metadata={"epoch": "5", "note": "from python"})
"""

CHECK = r"""
import sys, torch
from safetensors import safe_open
from safetensors.torch import load_file
a, b = load_file(sys.argv[1]), load_file(sys.argv[2])
assert sorted(a) == sorted(b), (sorted(a), sorted(b))
for k in a:
    assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
    assert torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8)), k
with safe_open(sys.argv[2], "pt") as f:
    assert f.metadata() == {"epoch": "5", "note": "from python"}, f.metadata()
print(len(a))
"""


class SafetensorsAgainstPython(unittest.TestCase):
    def setUp(self):
        if not VENV_PYTHON or not os.access(VENV_PYTHON, os.X_OK):
            raise unittest.SkipTest(f".venv's python is missing ({VENV_PYTHON!r}): run scripts/setup.sh")
        self.tool = binary("SAFETENSORS_TOOL", "safetensors_tool")
        self.tmp = tempfile.mkdtemp(prefix="dtrain_st_")
        self.addCleanup(shutil.rmtree, self.tmp, True)
        self.python_file = os.path.join(self.tmp, "python.safetensors")
        major = os.environ.get("TORCH_MAJOR", "1")
        subprocess.run([VENV_PYTHON, "-c", WRITE, self.python_file, major], check=True, timeout=120)

    def tool_run(self, src, dst):
        return subprocess.run([self.tool, src, dst], capture_output=True, text=True, timeout=60)

    def test_every_dtype_round_trips_bit_identical_both_ways(self):
        mine = os.path.join(self.tmp, "dtrain.safetensors")
        res = self.tool_run(self.python_file, mine)
        self.assertEqual(res.returncode, 0, res.stderr)
        out = subprocess.run([VENV_PYTHON, "-c", CHECK, self.python_file, mine], capture_output=True, text=True,
                             timeout=120)
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertGreaterEqual(int(out.stdout), 13)
        # dtrain lays the tensors out as Python does (by safetensors' dtype order, then by name): the
        # same header (Python's writer orders the metadata's keys as its hash map does) and the same
        # data, byte for byte.
        with open(self.python_file, "rb") as a, open(mine, "rb") as b:
            py, cc = a.read(), b.read()
        n = int.from_bytes(py[:8], "little")
        self.assertEqual(py[:8], cc[:8])
        self.assertEqual(json.loads(py[8:8 + n]), json.loads(cc[8:8 + n]))
        self.assertEqual(py[8 + n:], cc[8 + n:])

    def test_damaged_files_are_refused_naming_the_file_and_the_byte(self):
        with open(self.python_file, "rb") as f:
            good = f.read()
        n = int.from_bytes(good[:8], "little")
        header = good[8:8 + n]
        # The entry whose data ends last: cutting the file's tail leaves it short, and the error points
        # at its key in the header.
        last = max(json.loads(header).items(), key=lambda kv: kv[1]["data_offsets"][1] if "data_offsets" in kv[1] else -1)[0]
        garbled = b"{\"a\": [1,"  # the JSON parser stops at the character after the comma
        cases = {  # the damaged bytes, words of the line, and the byte it must name
            "short": (good[:5], "less than its 8-byte header length", 0),
            "length_past_end": ((len(good) * 2).to_bytes(8, "little") + good[8:], "runs past the file's", 0),
            "bad_json": (good[:8] + garbled + good[8 + len(garbled):], "does not parse", 8 + len(garbled)),
            "truncated_data": (good[:-7], f"'{last}' spans data bytes", 8 + header.index(f'"{last}"'.encode())),
            "not_brace": (good[:8] + b"[" + good[9:], "does not start with '{'", 8),
        }
        for name, (data, words, byte) in cases.items():
            with self.subTest(case=name):
                path = os.path.join(self.tmp, name + ".safetensors")
                with open(path, "wb") as f:
                    f.write(data)
                res = self.tool_run(path, os.path.join(self.tmp, "out.safetensors"))
                self.assertEqual(res.returncode, 1, res.stderr)
                lines = res.stderr.strip().splitlines()
                self.assertEqual(len(lines), 1, res.stderr)
                self.assertIn(path, lines[0])
                self.assertIn(f" at byte {byte} ", lines[0])
                self.assertIn(words, lines[0])
        self.assertLess(8 + n, len(good))

    def test_hostile_headers_are_refused_in_one_line_and_read_in_linear_time(self):
        """Headers no writer makes, each answered with one bounded line naming the file and the byte, in
        time linear in the file: a shape element nested a million levels deep (its message printed it
        whole, recursively: a stack overflow), a header nested so, a shape whose element count times
        the element size wraps around to 0 bytes, a key of 5,000 characters with a newline, and
        40,000 empty tensors (one search of the header per key: more than 120 s)."""
        def file_of(header, data=b""):
            h = json.dumps(header).encode() if not isinstance(header, bytes) else header
            return len(h).to_bytes(8, "little") + h + data

        deep = 1_000_000
        nested_shape = (b'{"w": {"dtype": "F32", "data_offsets": [0, 0], "shape": [' + b"[" * deep + b"]" * deep +
                        b"]}}")
        nested_header = b'{"w": ' + b"[" * deep + b"]" * deep + b"}"
        long_key = "evil\n" + "k" * 5000
        cases = {  # the file, words of the line, and the byte it must name
            "nested_shape": (file_of(nested_shape), "nests deeper than 64 levels", 8 + nested_shape.index(b"[" * 64) + 62),
            "nested_header": (file_of(nested_header), "nests deeper than 64 levels", 8 + nested_header.index(b"[") + 63),
            "numel_wraps": (file_of({"w": {"dtype": "F32", "shape": [2**31, 2**31], "data_offsets": [0, 0]}}),
                            "'w' spans data bytes 0-0 of 0, but its shape and dtype take more", 8 + 1),
            "long_key": (file_of({long_key: {"dtype": "Q9", "shape": [], "data_offsets": [0, 0]}}),
                         "'evil\\nkkkk", 8 + 1),
            # A number no double holds: the parser's out_of_range, not a parse_error, escaped the
            # reader (found by fuzz_safetensors_header).
            "number_overflow": (file_of(b'{"w": {"dtype": "F32", "shape": [2e47483648], "data_offsets": [0, 0]}}'),
                                "its JSON header does not parse ([json.exception.out_of_range.406] number overflow", 8),
        }
        for name, (data, words, byte) in cases.items():
            with self.subTest(case=name):
                path = os.path.join(self.tmp, name + ".safetensors")
                with open(path, "wb") as f:
                    f.write(data)
                res = self.tool_run(path, os.path.join(self.tmp, "out.safetensors"))
                self.assertEqual(res.returncode, 1, res.stderr[-2000:])
                lines = res.stderr.strip().splitlines()
                self.assertEqual(len(lines), 1, res.stderr[-2000:])
                self.assertLess(len(lines[0]), 600, lines[0][:2000])
                self.assertIn(path, lines[0])
                self.assertIn(f" at byte {byte} ", lines[0])
                self.assertIn(words, lines[0])
        # 40,000 empty tensors are a valid file; read back and written again well within the timeout.
        many = os.path.join(self.tmp, "many.safetensors")
        with open(many, "wb") as f:
            f.write(file_of({f"t{k}": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]} for k in range(40_000)}))
        res = self.tool_run(many, os.path.join(self.tmp, "many_out.safetensors"))
        self.assertEqual(res.returncode, 0, res.stderr[-2000:])


if __name__ == "__main__":
    unittest.main()
