"""TensorBoard's side of test_tensorboard.py; run it with the Python that has the `tensorboard`
package (.venv/bin/python, installed by scripts/setup.sh). Prints JSON on stdout.

  tensorboard_read.py runs LOGDIR          every run under LOGDIR (a folder holding event files, named
                                           by its path relative to LOGDIR, "." for LOGDIR itself) as
                                           TensorBoard's EventAccumulator loads it
  tensorboard_read.py records FILE         each record's offset and length, and whether both masked
                                           CRC-32Cs match (TensorBoard's own crc32c)
  tensorboard_read.py reference DIR        PyTorch's histogram (torch.utils.tensorboard) of the float64
                                           values in each DIR/<name>.f64, with SummaryWriter's bins
"""
import json
import os
import struct
import sys


def histogram_dict(h):
    return {"min": h.min, "max": h.max, "num": h.num, "sum": h.sum, "sum_squares": h.sum_squares,
            "bucket_limit": list(h.bucket_limit), "bucket": list(h.bucket)}


def read_run(path):
    from tensorboard.backend.event_processing import event_accumulator as ea
    acc = ea.EventAccumulator(path, size_guidance={ea.SCALARS: 0, ea.HISTOGRAMS: 0, ea.TENSORS: 0})
    acc.Reload()
    tags = acc.Tags()
    run = {"file_version": acc.file_version, "scalars": {}, "histograms": {}, "tensors": {}}
    for tag in tags["scalars"]:
        run["scalars"][tag] = [[e.wall_time, e.step, e.value] for e in acc.Scalars(tag)]
    for tag in tags["histograms"]:
        run["histograms"][tag] = [dict(step=e.step, **histogram_dict(e.histogram_value)) for e in acc.Histograms(tag)]
    for tag in tags["tensors"]:
        plugin = acc.SummaryMetadata(tag).plugin_data.plugin_name
        run["tensors"][tag] = [{"step": e.step, "plugin": plugin, "dtype": e.tensor_proto.dtype,
                                "shape": [d.size for d in e.tensor_proto.tensor_shape.dim],
                                "strings": [s.decode("utf-8") for s in e.tensor_proto.string_val]}
                               for e in acc.Tensors(tag)]
    return run


def runs(logdir):
    out = {}
    for folder, _, files in os.walk(logdir):
        if any("tfevents" in f for f in files):
            out[os.path.relpath(folder, logdir)] = read_run(folder)
    return out


def records(path):
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c
    data = open(path, "rb").read()
    out, at = [], 0
    while at + 12 <= len(data):
        (n,) = struct.unpack("<Q", data[at:at + 8])
        (len_crc,) = struct.unpack("<I", data[at + 8:at + 12])
        body = data[at + 12:at + 12 + n]
        crc_bytes = data[at + 12 + n:at + 16 + n]
        whole = len(body) == n and len(crc_bytes) == 4
        out.append({"offset": at, "length": n, "length_crc_ok": len_crc == masked_crc32c(data[at:at + 8]),
                    "data_crc_ok": whole and struct.unpack("<I", crc_bytes)[0] == masked_crc32c(body),
                    "whole": whole})
        at += 16 + n
    return {"records": out, "size": len(data), "end": at}


def reference(folder):
    import numpy as np
    from torch.utils.tensorboard import summary
    # SummaryWriter.__init__'s default_bins ("tensorflow"), without creating a writer and its file.
    v, pos = 1e-12, []
    while v < 1e20:
        pos.append(v)
        v *= 1.1
    bins = [-x for x in reversed(pos)] + [0] + pos
    out = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".f64"):
            values = np.fromfile(os.path.join(folder, name), dtype=np.float64)
            proto = summary.histogram(name[:-4], values, bins).value[0].histo
            out[name[:-4]] = histogram_dict(proto)
    out["_bins"] = bins
    return out


if __name__ == "__main__":
    mode, arg = sys.argv[1], sys.argv[2]
    json.dump({"runs": runs, "records": records, "reference": reference}[mode](arg), sys.stdout)
