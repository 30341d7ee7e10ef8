"""A minimal client of dtrain's rendezvous store (src/store/protocol.h) for tests: what any process
that reaches an open store can send. Frames are `u32 length | payload`; a field is `u32 length |
bytes`; integers are 8-byte little-endian fields."""
import socket
import struct

SET, GET, COMPARE_SET, ADD, CHECK, DELETE, NUM_KEYS, WAIT, AUTH = range(1, 10)


def _field(v):
    b = struct.pack("<q", v) if isinstance(v, int) else (v.encode() if isinstance(v, str) else v)
    return struct.pack("<I", len(b)) + b


def _read_exact(sock, n):
    out = b""
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise ConnectionError("the store closed the connection")
        out += chunk
    return out


def read_frame(sock):
    (n,) = struct.unpack("<I", _read_exact(sock, 4))
    return _read_exact(sock, n)


def frame(op, *fields):
    """The request frame of `op` with `fields` (str, bytes or int)."""
    payload = bytes([op]) + b"".join(_field(f) for f in fields)
    return struct.pack("<I", len(payload)) + payload


class OpenStore:
    """A connection to an open store (no job secret): the greeting read, an empty AUTH answered."""

    def __init__(self, port, host="127.0.0.1", timeout=10):
        self.sock = socket.create_connection((host, port), timeout=timeout)
        hello = read_frame(self.sock)
        magic_len = struct.unpack("<I", hello[1:5])[0]
        (auth,) = struct.unpack("<q", hello[5 + magic_len + 4:5 + magic_len + 12])
        if auth:
            raise PermissionError("the store requires a job secret")
        self.call(AUTH, b"", b"")

    def call(self, op, *fields):
        self.sock.sendall(frame(op, *fields))
        answer = read_frame(self.sock)
        if answer[0] != 0:
            raise RuntimeError(f"the store answered status {answer[0]}: {answer[5:].decode(errors='replace')}")
        return answer[1:]

    def set(self, key, value):
        self.call(SET, key, value)

    def add(self, key, delta):
        return struct.unpack("<q", self.call(ADD, key, delta)[4:12])[0]

    def close(self):
        self.sock.close()
