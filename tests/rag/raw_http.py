"""One HTTP/1.1 request written on a raw socket, for tests that must send what no client library sends.

A test can declare a body (Content-Length, or chunks without the final one) that it never finishes
sending: a server that waited for the whole body before answering would never answer, and the
socket times out, so an answer at all proves the server did not wait.
"""

from __future__ import annotations

import json
import socket
from urllib.parse import urlsplit


def raw_request(url: str, head: list[str], body: bytes = b"", timeout: float = 30.0) -> tuple[int, dict]:
    """Send the request line and headers of `head` (Host is added), then `body` as given; read one
    JSON response. Returns its status and decoded body."""
    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=timeout) as sock:
        sock.sendall(("\r\n".join([*head, f"Host: {parts.netloc}", "", ""])).encode() + body)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            assert chunk, "the server closed the connection without answering"
            data += chunk
        header, _, rest = data.partition(b"\r\n\r\n")
        lines = header.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        fields = dict(line.partition(": ")[::2] for line in lines[1:])
        length = int(next(v for k, v in fields.items() if k.lower() == "content-length"))
        while len(rest) < length:
            rest += sock.recv(65536)
    return status, json.loads(rest[:length])
