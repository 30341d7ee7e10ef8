"""Helpers that the Python test suites in tests/dist and tests/launcher share (stdlib only)."""
import socket
import time


def free_port():
    """A TCP port on 127.0.0.1 that was free a moment ago (bind port 0, read it, close; a tiny race,
    acceptable in tests)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(pred, timeout=10.0, step=0.05):
    """Polls pred() every `step` seconds until it is true (returns True) or `timeout` seconds passed
    (returns pred()'s last value)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(step)
    return pred()
