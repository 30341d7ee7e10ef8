#!/usr/bin/env python3
"""Runs an example for ctest and checks that it trained: the exit status, its RESULT line, a loss that falls.

  check_result.py [--timeout S] PATTERN -- COMMAND [ARGS...]

Passes only when all of these hold:
  * COMMAND exits 0 within S seconds (default 170; its whole process group is killed after that);
  * its output has exactly one `RESULT key=value ...` line (rank 0's; dtrain-run's `[rank N] ` prefix
    is allowed), and that line matches the regular expression PATTERN from its start;
  * the line has first_loss and final_loss, and final_loss < first_loss: the example learned;
  * every `*_agree` value on it is 1 (the ranks ended with the same parameters).

A PASS_REGULAR_EXPRESSION alone would let ctest ignore the exit status, so a crash after the RESULT
line, or a loss that does not move, would pass.
"""
import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile

RESULT = re.compile(r"^(?:\[rank \d+\] )?(RESULT(?: \S+=\S+)+)\s*$")


def run(command, timeout):
    """(exit status, merged stdout and stderr); the command runs in its own session so that a
    timeout, or ctest stopping this script, also ends the ranks a launcher started."""
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

        def kill_group(*_):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

        signal.signal(signal.SIGTERM, lambda *a: (kill_group(), sys.exit(1)))
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_group()
            rc = proc.wait()
            print(f"check_result: killed after {timeout:.0f} s")
        kill_group()  # anything the command left running in its session
        out.seek(0)
        return rc, out.read()


def check(pattern, rc, output):
    """The problems found, one line each (empty: the run passed)."""
    if rc != 0:
        return [f"the command exited with status {rc}, expected 0"]
    lines = [m.group(1) for m in map(RESULT.match, output.splitlines()) if m]
    if len(lines) != 1:
        return [f"expected exactly one RESULT line, found {len(lines)}"]
    line = lines[0]
    problems = []
    if not re.match(pattern, line):
        problems.append(f"the RESULT line does not match {pattern!r}")
    values = dict(field.split("=", 1) for field in line.split()[1:])
    try:
        first, final = float(values["first_loss"]), float(values["final_loss"])
        if not final < first:
            problems.append(f"the loss did not fall: first_loss={first} final_loss={final}")
    except KeyError as e:
        problems.append(f"the RESULT line has no {e.args[0]}: print it so the test can see the loss fall")
    except ValueError as e:
        problems.append(f"a loss on the RESULT line is not a number: {e}")
    problems += [f"{k}={v}: the ranks ended with different parameters"
                 for k, v in values.items() if k.endswith("_agree") and v != "1"]
    return problems


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout", type=float, default=170)
    parser.add_argument("pattern")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command after --")
    rc, output = run(command, args.timeout)
    sys.stdout.write(output)
    problems = check(args.pattern, rc, output)
    for p in problems:
        print(f"check_result: FAIL: {p}")
    if not problems:
        print("check_result: ok: exit status 0, one RESULT line, the loss fell")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
