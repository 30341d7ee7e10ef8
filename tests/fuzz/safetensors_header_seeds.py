"""Writes the seeds of the fuzz target safetensors_header (corpus/safetensors_header/): a file Python's
`safetensors` writes, and small forms of the hostile headers test_safetensors.py refuses (a nested
shape element, a nested header, a shape whose byte count wraps around to 0, a number out of any double's range, a key with a newline).

    .venv/bin/python tests/fuzz/safetensors_header_seeds.py tests/fuzz/corpus/safetensors_header
"""
import json
import os
import sys

import torch
from safetensors.torch import save


def file_of(header):
    h = header if isinstance(header, bytes) else json.dumps(header).encode()
    return len(h).to_bytes(8, "little") + h


def seeds():
    yield "python", save({"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(2, dtype=torch.bfloat16),
                          "e": torch.zeros(0, 4)}, metadata={"epoch": "5"})
    yield "nested_shape", file_of(b'{"w": {"dtype": "F32", "data_offsets": [0, 0], "shape": [' + b"[" * 70 + b"]" * 70 +
                                  b"]}}")
    yield "nested_header", file_of(b'{"w": ' + b"[" * 70 + b"]" * 70 + b"}")
    yield "numel_wraps", file_of({"w": {"dtype": "F32", "shape": [2**31, 2**31], "data_offsets": [0, 0]}})
    yield "number_overflow", file_of(b'{"w": {"dtype": "F32", "shape": [2e47483648], "data_offsets": [0, 0]}}')
    yield "key_with_newline", file_of({"evil\n" + "k" * 100: {"dtype": "Q9", "shape": [], "data_offsets": [0, 0]}})


if __name__ == "__main__":
    for name, data in seeds():
        with open(os.path.join(sys.argv[1], name), "wb") as f:
            f.write(data)
        print(name, len(data))
