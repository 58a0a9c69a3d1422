"""The kvfabric agents a path needs for engines that run on them (NIXL's KVFABRIC backend): over
tcp one agent per side in that side's network namespace, as one per node in a cluster, found
through an etcd in the target's namespace and proven to each other by a token of the run; where
both sides are one node (the shm and GPU IPC paths) one agent for both, as two workers of a node
share theirs."""

from __future__ import annotations

import contextlib
import json
import secrets
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from .errors import Kind, PeerError

START_S = 30.0


def _free_port(host: str, ns: str | None) -> int:
    """A port free on `host` inside `ns` (asked there: another namespace has its own ports)."""
    if ns is None:
        with socket.socket() as s:
            s.bind((host, 0))
            return int(s.getsockname()[1])
    code = f"import socket; s = socket.socket(); s.bind(({host!r}, 0)); print(s.getsockname()[1])"
    out = subprocess.run(
        in_namespace(ns, ["python3", "-c", code]),
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    return int(out.stdout.strip())


def in_namespace(ns: str | None, argv: list[str]) -> list[str]:
    """`argv` run inside network namespace `ns` (None: where we are)."""
    return ["ip", "netns", "exec", ns, *argv] if ns else argv


class _Children:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.procs: list[subprocess.Popen[str]] = []

    def start(self, name: str, argv: list[str]) -> subprocess.Popen[str]:
        log = open(self.root / f"{name}.log", "w")  # noqa: SIM115
        p = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True
        )
        self.procs.append(p)
        return p

    def why(self, name: str) -> str:
        return (self.root / f"{name}.log").read_text(errors="replace")[-600:]

    def stop(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                p.kill()
                p.wait()


def _etcd(children: _Children, host: str, ns: str | None) -> str:
    client, peer = _free_port(host, ns), _free_port(host, ns)
    url, peer_url = f"http://{host}:{client}", f"http://{host}:{peer}"
    binary = shutil.which("etcd") or "/usr/bin/etcd"
    argv = [binary, "--data-dir", str(children.root / "etcd"), "--listen-client-urls", url]
    argv += ["--advertise-client-urls", url, "--listen-peer-urls", peer_url]
    argv += ["--initial-advertise-peer-urls", peer_url, "--initial-cluster", f"default={peer_url}"]
    p = children.start("etcd", in_namespace(ns, argv))
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        code = f"import socket; socket.create_connection(({host!r}, {client}), 1)"
        probe = subprocess.run(in_namespace(ns, ["python3", "-c", code]), capture_output=True)
        if probe.returncode == 0:
            return url
        if p.poll() is not None:
            break
        time.sleep(0.2)
    raise PeerError(Kind.ENGINE, "etcd", f"did not start: {children.why('etcd')}")


def _agent(
    children: _Children, binary: str, name: str, host: str, ns: str | None, extra: list[str]
) -> str:
    """Starts one agent; returns its socket directory once it has said it is ready."""
    sockets = children.root / name
    sockets.mkdir()
    argv = [binary, "agent", "--name", name, "--fabric", "peer-bench"]
    argv += ["--socket-dir", str(sockets), "--grpc-addr", f"{host}:0", "--data-addr", f"{host}:0"]
    argv += ["--metrics-addr", f"{host}:0", "--advertise-addr", host, *extra]
    p = children.start(name, in_namespace(ns, argv))
    assert p.stdout is not None
    ready: list[str] = []
    reader = threading.Thread(target=lambda: ready.append(p.stdout.readline()))
    reader.daemon = True
    reader.start()
    reader.join(START_S)
    try:
        json.loads(ready[0] if ready else "")
    except ValueError:
        raise PeerError(Kind.ENGINE, f"agent {name}", f"not ready: {children.why(name)}") from None
    return str(sockets)


@contextlib.contextmanager
def agents(
    binary: str,
    server: tuple[str | None, str],
    client: tuple[str | None, str],
    transport: str,
) -> Iterator[tuple[dict[str, str], dict[str, str]]]:
    """The environment of the target's and the initiator's processes, (namespace, address) each,
    with their agents running; everything is stopped on leaving. `transport` tcp: one agent per
    side, tcp between them; otherwise one agent for both (one node)."""
    root = Path(tempfile.mkdtemp(prefix="kvfabric-peer-bench-"))
    children = _Children(root)
    try:
        extra = ["--peer-token", secrets.token_hex(24)]
        if transport != "tcp":
            # One node: its agent alone, no registry to share.
            there = _agent(children, binary, "node", server[1], server[0], extra)
            here = there
        else:
            etcd = _etcd(children, server[1], server[0])
            extra += ["--etcd-endpoints", etcd, "--transports", "tcp"]
            there = _agent(children, binary, "node-target", server[1], server[0], extra)
            here = _agent(children, binary, "node-initiator", client[1], client[0], extra)
        yield {"KVFABRIC_SOCKET_DIR": there}, {"KVFABRIC_SOCKET_DIR": here}
    finally:
        children.stop()
        shutil.rmtree(root, ignore_errors=True)
