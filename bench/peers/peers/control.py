"""The control channel between a driver's initiator and its target: length-prefixed JSON
messages, each optionally followed by a binary attachment. The first message must carry the
run's token; a connection that does not is closed without a word. Every read has a deadline and
every length is bounded before anything is allocated for it."""

from __future__ import annotations

import contextlib
import hmac
import json
import socket
import struct
from typing import Any

from .errors import Kind, PeerError, truncated

MAX_HEADER = 1 << 20
MAX_ATTACHMENT = 256 << 20
TIMEOUT_S = 120.0
# How long a target waits for the next request (a whole row runs in between).
IDLE_S = 3600.0

Message = dict[str, Any]


def _read_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise PeerError(Kind.CONTROL, "connection", f"closed after {got} of {n} bytes")
        got += k
    return bytes(buf)


def send(sock: socket.socket, message: Message, attachment: bytes = b"") -> None:
    if attachment:
        message = {**message, "attachment": len(attachment)}
    header = json.dumps(message).encode()
    sock.sendall(struct.pack(">I", len(header)) + header + attachment)


def recv(sock: socket.socket) -> tuple[Message, bytes]:
    (n,) = struct.unpack(">I", _read_exact(sock, 4))
    if n > MAX_HEADER:
        raise PeerError(Kind.CONTROL, "header", f"{n} bytes, more than {MAX_HEADER}")
    try:
        message = json.loads(_read_exact(sock, n))
    except ValueError as e:
        raise PeerError(Kind.CONTROL, "header", f"not JSON: {truncated(str(e))}") from e
    if not isinstance(message, dict):
        raise PeerError(Kind.CONTROL, "header", f"not an object: {truncated(message)}")
    size = message.get("attachment", 0)
    if not isinstance(size, int) or not 0 <= size <= MAX_ATTACHMENT:
        raise PeerError(Kind.CONTROL, "attachment", f"{truncated(size)} is not 0..{MAX_ATTACHMENT}")
    return message, _read_exact(sock, size) if size else b""


def authentic(message: Message, token: str) -> bool:
    offered = message.get("token")
    return isinstance(offered, str) and hmac.compare_digest(offered.encode(), token.encode())


class Client:
    def __init__(self, address: str, token: str) -> None:
        host, _, port = address.rpartition(":")
        self.sock = socket.create_connection((host, int(port)), timeout=TIMEOUT_S)
        self.sock.settimeout(TIMEOUT_S)
        self.hello = self.call({"op": "hello", "token": token})

    def call(self, message: Message, attachment: bytes = b"") -> Message:
        send(self.sock, message, attachment)
        try:
            reply, _ = recv(self.sock)
        except TimeoutError as e:
            raise PeerError(
                Kind.TIMEOUT, str(message.get("op")), f"no reply in {TIMEOUT_S} s"
            ) from e
        if "error" in reply:
            raise PeerError(Kind.ENGINE, f"target {message.get('op')}", str(reply["error"]))
        return reply

    def close(self) -> None:
        with contextlib.suppress(OSError):
            send(self.sock, {"op": "bye"})
        self.sock.close()
