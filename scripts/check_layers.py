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
A layer's internal headers are its own: another layer may include only those EXPORTS lists (each
with what it is for), as a library exports some of its headers. And CONTRIBUTING.md stays true to
this file: its code map names every folder of src/, and its table of layer rules is USES.
  scripts/check_layers.py --update   rewrites CONTRIBUTING.md's table from USES
Exit status 0 clean, 1 with one line per problem.
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
    "fsdp": {"comm", "compat", "common"},
    "data": {"comm", "compat", "common"},
    "pipeline": {"ddp", "parallel", "comm", "compat", "common"},
    "checkpoint": {"amp", "data", "optim", "comm", "compat", "common"},
    "monitor": {"ddp", "comm", "compat", "common"},
    "tp": {"comm", "compat", "common"},
    "cp": {"tp", "comm", "compat", "common"},
    "ep": {"tp", "comm", "compat", "common"},
    "ft": {"comm", "compat", "common", "store"},
    # The C API for other languages' bindings: the top layer, over dtrain's public API.
    "c_api": {"ddp", "fsdp", "amp", "data", "monitor", "checkpoint", "optim", "comm", "compat", "common"},
}

# The internal headers of each layer that other layers may include, and what for. Any other header of
# a layer is its own business: moving or changing it touches no other layer.
EXPORTS = {
    "store": {"store/store.h": "the store's client and server (comm's adapter, the launcher)"},
    "common": {
        "common/util.h": "strings, files and numbers every layer formats and parses alike",
        "common/env.h": "the typed readers of the environment table",
        "common/slurm.h": "Slurm's variables (the launch environment)",
        "common/pickle.h": "the bounded pickle reader (DCP metadata)",
        "common/flight_pickle.h": "the flight recorder's records in PyTorch's dump format",
        "common/flight_analysis.h": "what a job's flight records say went wrong",
        "common/malloc_threshold.h": "glibc's mmap threshold that fully_shard pins before it frees the whole parameters",
    },
    "compat": {
        "compat/amp_compat.h": "autocast state and the AMP kernels",
        "compat/autograd_compat.h": "accumulator hooks and the end-of-backward callback",
        "compat/c10d_compat.h": "c10d's ProcessGroup/Backend and Work API",
        "compat/optim_compat.h": "optimizer state across LibTorch versions",
        "compat/torchrun_store_compat.h": "torchrun 2.x's store handshake",
    },
    "comm": {
        "comm/capabilities.h": "what the group's backend can do, for the wrappers that pick collectives",
        "comm/state.h": "the process's groups and its rank facts",
        "comm/tags.h": "the table of reserved point-to-point tags",
        "comm/param_claims.h": "which wrapper owns a parameter (no parameter in two)",
        "comm/shard_groups.h": "the groups a gradient is sharded over (GradScaler's overflow flag)",
        "comm/model_sync.h": "the model check and state broadcast that DDP and fully_shard share",
        "comm/shard_specs.h": "where parallelize_module and fully_shard publish a parameter's ShardSpec",
        "comm/replica_group.h": "a Gloo group outside the world, per fault-tolerance quorum",
        "comm/scratch_collectives.h": "collectives that may work in a scratch input (fully_shard's gradients)",
    },
    "optim": {"optim/state_device.h": "where an optimizer's state lives, for checkpoints"},
    "tp": {"tp/dims.h": "a dimension argument checked and wrapped, with one error line (context parallel)"},
}

# The directory behind each public header (include/dtrain/NAME.h or include/dtrain/NAME/...).
PUBLIC_OWNER = {
    "errors": "common", "system": "common", "process_group": "comm", "amp": "amp", "ddp": "ddp", "comm_hooks": "ddp",
    "data_parallel": "parallel", "sampler": "data", "datasets": "data", "checkpoint": "checkpoint", "dcp": "checkpoint", "safetensors": "checkpoint",
    "monitor": "monitor", "summary_writer": "monitor", "pipeline": "pipeline", "detail": "common", "sync_batchnorm": "nn", "activation_checkpoint": "nn", "zero": "optim", "sharded_optimizer": "optim",
    "fsdp": "fsdp",
    "join": "comm",
    "device_mesh": "comm", "shard_spec": "comm", "tensor_parallel": "tp", "functional_collectives": "tp",
    "context_parallel": "cp",
    "expert_parallel": "ep",
    "fault_tolerance": "ft",
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


def check_exports(errors):
    """Every include of another layer's internal header is in EXPORTS; every export still exists."""
    for rel, n, inc, _ in each_include(SRC, (".h", ".cpp", ".cu"), INCLUDE):
        layer, to = rel.split("/")[1], inc.split("/", 1)[0]
        if to in USES and to != layer and to in USES.get(layer, set()) and inc not in EXPORTS.get(to, {}):
            errors.append(f"{rel}:{n}: includes \"{inc}\", which {to}/ does not export: use {to}/'s exported "
                          f"headers ({', '.join(sorted(EXPORTS.get(to, {}))) or 'none'}) or add it to EXPORTS "
                          "with what it is for")
    for to, headers in EXPORTS.items():
        for header in headers:
            if not os.path.isfile(os.path.join(SRC, header)):
                errors.append(f"scripts/check_layers.py: EXPORTS names {header}, which src/ no longer has")


def layer_table():
    rows = ["| folder | may use, besides itself |", "|---|---|"]
    for layer in sorted(USES):
        uses = ", ".join(f"`{u}/`" for u in sorted(USES[layer])) or "nothing"
        rows.append(f"| `{layer}/` | {uses} |")
    return "\n".join(rows) + "\n"


TABLE = re.compile(r"(<!-- layers:begin -->\n)(.*?)(<!-- layers:end -->)", re.S)


def check_contributing(errors, update):
    path = os.path.join(ROOT, "CONTRIBUTING.md")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    folders = sorted(d for d in os.listdir(SRC) if os.path.isdir(os.path.join(SRC, d)))
    for d in folders:
        if d not in USES:
            errors.append(f"src/{d}/ has no row in USES: say which layers it may use (docs/design.md's arrows)")
        if f"- `src/{d}/`" not in text:
            errors.append(f"CONTRIBUTING.md: the code map has no line \"- `src/{d}/` — ...\": say what the folder holds")
    for d in USES:
        if d not in folders:
            errors.append(f"scripts/check_layers.py: USES has a row for src/{d}/, which does not exist")
    m = TABLE.search(text)
    if not m:
        errors.append("CONTRIBUTING.md: no <!-- layers:begin --> ... <!-- layers:end --> table of layer rules")
    elif m.group(2) != layer_table():
        if update:
            with open(path, "w", encoding="utf-8") as f:
                f.write(text[:m.start(2)] + layer_table() + text[m.end(2):])
        else:
            errors.append("CONTRIBUTING.md: the table of layer rules differs from USES: run scripts/check_layers.py "
                          "--update")


def main():
    errors = []
    check_exports(errors)
    check_contributing(errors, "--update" in sys.argv[1:])
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
        print(f"check_layers: {len(errors)} problem(s) against docs/design.md's layers and CONTRIBUTING.md's "
              "rules: move the code or the include so each arrow points down")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
