#!/usr/bin/env python3
"""Passes when every reduction loop of the shared-memory kernels is vectorized.

src/comm/shm/kernels.cpp keeps each (element type, operation) loop in its own function: loop<T, Op>
for float and double, loop16<BFloat16, Op>, and loop_f16c<Op> for float16 (F16C; loop16<Half, Op>
is only its tail and the fallback on CPUs without F16C, and stays scalar). This disassembles the
object file and checks each of them for a packed (SIMD) instruction of its operation: add/mul/min/max
on packed floats or doubles (a packed division for the float/double SumDivA and SumDivB, the SUMs
that divide this rank's values on their way in); for min and max a packed compare also counts (the bfloat16 loops widen
to float and select with cmpltps and a blend). One scalar loop fails the check, named, so a compiler
or flag change cannot leave one type slow while the others hide it.

  check_vectorized.py OBJECT
"""
import re
import subprocess
import sys

OPS = {"Sum": r"v?addp[sd]", "Prod": r"v?mulp[sd]", "Min": r"v?(minp[sd]|cmpl[te]p[sd]|cmpnl[te]p[sd]|blendvp[sd])",
       "Max": r"v?(maxp[sd]|cmpl[te]p[sd]|cmpnl[te]p[sd]|blendvp[sd])",
       # SUM with this rank's contribution divided on its way in (float and double only).
       "SumDivA": r"v?divp[sd]", "SumDivB": r"v?divp[sd]"}
WIDE_ONLY = {"SumDivA", "SumDivB"}
NS = r"dtrain::shm::\(anonymous namespace\)::"
LOOP = re.compile(r"^[0-9a-f]+ <void " + NS + r"loop(?:16)?<([\w:]+), " + NS + r"(\w+)>")
F16C = re.compile(r"^[0-9a-f]+ <void " + NS + r"loop_f16c<" + NS + r"(\w+)>")
TYPES = ["float", "double", "c10::Half(F16C)", "c10::BFloat16"]


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: check_vectorized.py OBJECT")
    dis = subprocess.run(["objdump", "-d", "-C", "--no-show-raw-insn", sys.argv[1]], check=True,
                         capture_output=True, text=True).stdout
    loops, current = {}, None
    for line in dis.splitlines():
        if re.match(r"^[0-9a-f]+ <", line):
            m, f = LOOP.match(line), F16C.match(line)
            current = (m.group(1), m.group(2)) if m else ("c10::Half(F16C)", f.group(1)) if f else None
            if current:
                loops.setdefault(current, [])
        elif current and "\t" in line:
            loops[current].append(line.split("\t")[-1].split()[0] if line.split("\t")[-1].split() else "")
    expected = [(t, op) for t in TYPES for op in OPS if op not in WIDE_ONLY or t in ("float", "double")]
    missing = [f"{t}/{op}" for t, op in expected if (t, op) not in loops]
    scalar = [f"{t}/{op}" for t, op in expected
              if (t, op) in loops and not any(re.fullmatch(OPS[op], ins) for ins in loops[(t, op)])]
    if missing:
        print(f"check_vectorized: loops not found as functions in {sys.argv[1]}: {', '.join(missing)} "
              "(are they still noinline in kernels.cpp?)", file=sys.stderr)
    if scalar:
        print(f"check_vectorized: scalar reduction loops in {sys.argv[1]}: {', '.join(scalar)} "
              "(is -O3 applied, or is a precompiled header overriding it?)", file=sys.stderr)
    if missing or scalar:
        return 1
    print(f"check_vectorized: all {len(expected)} reduction loops use packed instructions")
    return 0


if __name__ == "__main__":
    sys.exit(main())
