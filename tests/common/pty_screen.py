"""Runs a command on a pseudo-terminal and replays what it wrote as a terminal would (tests only).

run_on_pty() gives the raw bytes a user's terminal received; Screen turns them into the lines left
on the screen, understanding what dtrain-run's bar uses: '\r' (column 0), '\n' (next line, column 0:
the pty's ONLCR), erase-line ESC[2K / ESC[K / ESC[0K, and plain text that overwrites from the cursor.
Any other escape sequence is an error: the test must see exactly what the launcher emits.
"""
import os
import pty
import re
import select
import signal
import struct
import subprocess
import termios
import fcntl
import time

CSI_RE = re.compile(rb"\x1b\[([0-9;]*)([A-Za-z])")


def run_on_pty(argv, env, timeout, cols=200):
    """Runs argv with stdout and stderr on one pty of `cols` columns; returns (returncode, bytes)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, cols, 0, 0))
    proc = subprocess.Popen([str(a) for a in argv], env=env, stdin=subprocess.DEVNULL, stdout=slave,
                            stderr=slave, start_new_session=True)
    os.close(slave)
    data = bytearray()
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            r, _, _ = select.select([master], [], [], 0.2)
            if r:
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # EIO: every writer closed the pty
                    break
                if not chunk:
                    break
                data += chunk
            elif proc.poll() is not None:
                # Exited: what is still buffered in the pty comes with the next reads, then EIO.
                continue
        else:
            os.killpg(proc.pid, signal.SIGKILL)
            raise TimeoutError(f"{argv[0]} did not finish within {timeout} s; output so far:\n"
                               + data.decode(errors="replace")[-3000:])
        return proc.wait(timeout=10), bytes(data)
    finally:
        os.close(master)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


class Screen:
    """The lines a terminal shows after receiving `data` (no scrolling limit, no wrapping: the
    launcher cuts its bar to the terminal's width)."""

    def __init__(self, data):
        self.lines = [[]]
        self.col = 0
        self.row = 0
        i = 0
        while i < len(data):
            b = data[i]
            if b == 0x1b:
                m = CSI_RE.match(data, i)
                if not m:
                    raise ValueError(f"unexpected escape sequence at byte {i}: {data[i:i + 12]!r}")
                arg, cmd = m.group(1), m.group(2)
                if cmd != b"K" or arg not in (b"", b"0", b"2"):
                    raise ValueError(f"unexpected escape sequence {m.group(0)!r} at byte {i}")
                line = self.lines[self.row]
                if arg == b"2":
                    line.clear()
                else:
                    del line[self.col:]
                i = m.end()
                continue
            if b == 0x0d:
                self.col = 0
            elif b == 0x0a:
                self.row += 1
                self.col = 0
                if self.row == len(self.lines):
                    self.lines.append([])
            else:
                line = self.lines[self.row]
                while len(line) < self.col:
                    line.append(" ")
                if self.col < len(line):
                    line[self.col] = chr(b)
                else:
                    line.append(chr(b))
                self.col += 1
            i += 1

    def text(self):
        """The screen's lines, trailing blanks and the empty last line dropped."""
        out = ["".join(l).rstrip() for l in self.lines]
        while out and out[-1] == "":
            out.pop()
        return out
