#!/usr/bin/env python3
"""Fails when a source file includes a header of a layer it must not use (docs/design.md, "Layers
and dependency direction" and "comm/ inside").

  scripts/check_layers.py

Every `#include "..."` in src/ is mapped to the layer that owns the header: src/DIR/... belongs to
DIR, and each public header include/dtrain/NAME.h to the directory that implements it. A file may
include its own layer and the layers its directory lists in USES below; comm/ has its own one-way
order inside (COMM_RULES). Two more rules outside src/:
  - include/dtrain/ (the public API) includes only other public headers in quotes: never src/'s
    internals, which are not installed; a public header of layer A includes public headers of A and
    of the layers A uses, not of layers above it;
  - tools/ (dtrain-run, which starts in milliseconds) never includes LibTorch (<torch/...>, <ATen/...>,
    <c10/...>) nor dtrain's library, only store/, common/ (util, env, slurm) and its own files.
Exit status 0 clean, 1 with one line per offending include.
"""
import fnmatch
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SRC = os.path.join(ROOT, "src")

# What each directory of src/ may use besides itself: the arrows of docs/design.md's diagram.
USES = {
    "store": set(),
    "common": set(),
    "compat": {"common"},
    "comm": {"common", "compat", "store"},
    "ddp": {"comm", "compat", "common"},
    "amp": {"comm", "compat", "common"},
    "parallel": {"comm", "compat", "common"},
    "nn": {"comm", "compat", "common"},
    "optim": {"comm", "compat", "common"},
    "fsdp": {"ddp", "comm", "compat", "common"},
    "data": {"comm", "compat", "common"},
    "pipeline": {"ddp", "parallel", "comm", "compat", "common"},
    "checkpoint": {"amp", "data", "optim", "fsdp", "tp", "comm", "compat", "common"},
    "monitor": {"ddp", "comm", "compat", "common"},
    "tp": {"comm", "compat", "common"},
}

# The directory behind each public header (include/dtrain/NAME.h or include/dtrain/NAME/...).
PUBLIC_OWNER = {
    "errors": "common", "system": "common", "process_group": "comm", "amp": "amp", "ddp": "ddp", "comm_hooks": "ddp",
    "data_parallel": "parallel", "sampler": "data", "datasets": "data", "checkpoint": "checkpoint", "dcp": "checkpoint", "safetensors": "checkpoint",
    "monitor": "monitor", "summary_writer": "monitor", "pipeline": "pipeline", "detail": "common", "sync_batchnorm": "nn", "zero": "optim", "sharded_optimizer": "optim",
    "fsdp": "fsdp",
    "join": "comm",
    "device_mesh": "tp", "tensor_parallel": "tp", "functional_collectives": "tp",
}

# comm/ inside, one way: front end -> factory (backend.h) -> backends -> lowest layer.
# (file pattern, include patterns it must not use, why[, includes allowed in spite of them])
BACKENDS = ["comm/shm/*", "comm/gloo_backend.h"]
COMM_RULES = [
    ("comm/shm/*", ["comm/backend.h", "comm/state.h", "comm/debug_check.h", "comm/init*"],
     "a backend sees only backend_config.h, capabilities.h and gloo_backend.h of comm/"),
    ("comm/gloo_backend.*", ["comm/backend.h", "comm/shm/*", "comm/state.h"],
     "a backend sees only backend_config.h and capabilities.h of comm/"),
    ("comm/backend_config.h", ["comm/*"], "the lowest layer of comm/ includes nothing of comm/"),
    ("comm/capabilities.*", ["comm/*"], "the backend interface sees only backend_config.h of comm/",
     ["comm/backend_config.h"]),
    ("comm/tags.h", ["comm/*"], "the table of reserved tags includes nothing of comm/"),
]
# Everything else in comm/ is front end: it reaches backends only through backend.h.
FRONT_END_EXEMPT = ["comm/shm/*", "comm/gloo_backend.*", "comm/backend.cpp", "comm/backend_config.h",
                    "comm/capabilities.*"]

INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"')
ANY_INCLUDE = re.compile(r'^\s*#\s*include\s+[<"]([^>"]+)[>"]')
TOOLS_MAY_USE = ("store/", "common/util.h", "common/env.h", "common/slurm.h", "common/flight_analysis.h")
TORCH_HEADERS = ("torch/", "ATen/", "c10/", "caffe2/")


def each_include(top, exts, pattern):
    """(path relative to the repository, line number, included name, line) for each include in `top`."""
    for dirpath, _, files in os.walk(top):
        for f in sorted(files):
            if not f.endswith(exts):
                continue
            full = os.path.join(dirpath, f)
            with open(full, encoding="utf-8") as fh:
                for n, line in enumerate(fh, 1):
                    m = pattern.match(line)
                    if m:
                        yield os.path.relpath(full, ROOT), n, m.group(1), line


def check_public_headers(errors):
    for rel, n, inc, _ in each_include(os.path.join(ROOT, "include", "dtrain"), (".h",), INCLUDE):
        layer = PUBLIC_OWNER.get(rel.split("/")[2].split(".")[0])
        where = f"{rel}:{n}: includes \"{inc}\""
        if not inc.startswith("dtrain/"):
            errors.append(f"{where}: a public header includes only public headers (dtrain/...); "
                          "src/'s headers are not installed")
            continue
        to = owner(inc)
        if layer and to and to != "*" and to != layer and to not in USES.get(layer, set()):
            errors.append(f"{where}: the public header of {layer}/ must not use {to}/'s API "
                          f"({layer}/ may use: {', '.join(sorted(USES.get(layer, []))) or 'nothing'})")


def check_tools(errors):
    for rel, n, inc, line in each_include(os.path.join(ROOT, "tools"), (".h", ".cpp"), ANY_INCLUDE):
        where = f"{rel}:{n}: includes \"{inc}\""
        if inc.startswith(TORCH_HEADERS):
            errors.append(f"{where}: tools/ never includes LibTorch (the launcher starts in milliseconds and "
                          "links no torch)")
        elif '"' in line and "/" in inc and not inc.startswith(TOOLS_MAY_USE):
            errors.append(f"{where}: tools/ uses only store/, common/util.h, common/env.h, common/slurm.h, "
                          "common/flight_analysis.h and "
                          "its own files")


def owner(header):
    top = header.split("/", 1)[0]
    if top == "dtrain":
        name = header.split("/")[1].split(".")[0]
        return "*" if name == "dtrain" else PUBLIC_OWNER.get(name)
    return top if top in USES else None  # anything else is outside src/ (gloo_opaque, third party)


def matches(path, patterns):
    return any(fnmatch.fnmatch(path, p) for p in patterns)


def main():
    errors = []
    for dirpath, _, files in os.walk(SRC):
        for f in sorted(files):
            if not f.endswith((".h", ".cpp", ".cu")):
                continue
            path = os.path.relpath(os.path.join(dirpath, f), SRC)
            layer = path.split("/", 1)[0]
            with open(os.path.join(dirpath, f), encoding="utf-8") as fh:
                for n, line in enumerate(fh, 1):
                    m = INCLUDE.match(line)
                    if not m:
                        continue
                    inc = m.group(1)
                    where = f"src/{path}:{n}: includes \"{inc}\""
                    to = owner(inc)
                    if to == "*":
                        errors.append(f"{where}: the umbrella header is for users; include what is used")
                    elif to and to != layer and to not in USES.get(layer, set()):
                        errors.append(f"{where}: {layer}/ must not use {to}/ (it may use: "
                                      f"{', '.join(sorted(USES.get(layer, []))) or 'nothing'})")
                    for pattern, banned, why, *allowed in COMM_RULES:
                        if allowed and matches(inc, allowed[0]):
                            continue
                        if fnmatch.fnmatch(path, pattern) and matches(inc, banned) and inc != path:
                            if not (pattern.endswith("*") and fnmatch.fnmatch(inc, pattern)):
                                errors.append(f"{where}: {why}")
                    if path.startswith("comm/") and not matches(path, FRONT_END_EXEMPT) and matches(inc, BACKENDS):
                        errors.append(f"{where}: comm's front end reaches backends only through comm/backend.h")
    check_public_headers(errors)
    check_tools(errors)
    for e in errors:
        print(f"check_layers: {e}")
    if errors:
        print(f"check_layers: {len(errors)} include(s) against docs/design.md's layers; move the code or the "
              "include so each arrow points down")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
