"""Writes the hostile seeds of the fuzz target dcp_metadata (corpus/dcp_metadata/) with PyTorch's own
metadata classes, pickled as PyTorch pickles them (protocol 2, to keep them small): each one a file
that once crashed dcp::load (geometry_*) or took memory or time out of proportion to its size
(budget_*: values shared through the pickle's memo).

    .venv/bin/python tests/fuzz/dcp_metadata_seeds.py tests/fuzz/corpus/dcp_metadata
"""
import os
import pickle
import sys

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex,
                                                   TensorProperties, TensorStorageMetadata)

BIG = 2**63 - 1


def tensor(size, chunks):
    return TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size(size),
                                 [ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s)) for o, s in chunks])


def metadata(tensors, items):
    """tensors: {key: TensorStorageMetadata}; items: [(key, offsets, file offset, length)]."""
    return Metadata(state_dict_metadata=tensors, planner_data={k: (k,) for k in tensors},
                    storage_data={MetadataIndex(k, torch.Size(o), 0): _StorageInfo("__0_0.distcp", off, n)
                                  for k, o, off, n in items})


def seeds():
    yield "geometry_rankless_chunk", metadata({"w": tensor([4, 6], [((), (4, 6))])}, [("w", (), 0, 100)])
    yield "geometry_chunk_past_end", metadata({"w": tensor([4], [((3,), (2,))])}, [("w", (3,), 0, 100)])
    yield "geometry_chunk_overflow", metadata({"w": tensor([4], [((BIG,), (BIG,))])}, [("w", (BIG,), 0, 100)])
    yield "geometry_storage_overflow", metadata({"w": tensor([4], [((0,), (4,))])}, [("w", (0,), BIG - 1, 2)])
    chunk = ChunkStorageMetadata(offsets=torch.Size([0]), sizes=torch.Size([4]))
    t = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([4]), [chunk] * 64)
    yield "geometry_repeated_chunk", metadata({"w": t}, [("w", (0,), 0, 100)])
    yield "geometry_overlapping_items", metadata({"w": tensor([4], [((0,), (2,)), ((2,), (2,))])},
                                                 [("w", (0,), 0, 100), ("w", (2,), 50, 100)])


def shared_tensor(n):
    """n keys share one tensor whose n chunks share one torch.Size of n dimensions: a full copy holds n**3
    numbers (a 10 KB file took 1.6 GB)."""
    size = torch.Size([1] * n)
    chunk = ChunkStorageMetadata(offsets=torch.Size([0] * n), sizes=size)
    t = TensorStorageMetadata(TensorProperties(dtype=torch.float32), size, [chunk] * n)
    return Metadata(state_dict_metadata={f"k{i}": t for i in range(n)}, planner_data={}, storage_data={})


def budget_seeds():
    for n in (130, 250, 450):
        yield f"budget_shared_tensor_{n}", shared_tensor(n)
    # 500 keys whose paths are one tuple of 500 references to one str of 2000 bytes: 500 MB of text.
    text = "x" * 2000
    path = (text,) * 500
    yield "budget_shared_paths", Metadata(state_dict_metadata={}, planner_data={f"k{i}": path for i in range(500)},
                                          storage_data={})
    # Each level a pair of references to the one below: 2**40 values in 300 bytes.
    nested = []
    for _ in range(40):
        nested = (nested, nested)
    yield "budget_doubling", nested


if __name__ == "__main__":
    out = sys.argv[1]
    for name, m in list(seeds()) + list(budget_seeds()):
        with open(os.path.join(out, name), "wb") as f:
            pickle.dump(m, f, protocol=2)
        print(name, os.path.getsize(os.path.join(out, name)))
