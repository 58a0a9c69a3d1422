"""Real kvfabric components for the tests: agent processes (in-memory registry, or etcd) and a
throwaway etcd. Nothing here is mocked."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def kvfabric_bin() -> str:
    """``$KVFABRIC_BIN``, else the workspace's release build, else its debug build."""
    if os.environ.get("KVFABRIC_BIN"):
        return os.environ["KVFABRIC_BIN"]
    for profile in ("release", "debug"):
        p = REPO / "target" / profile / "kvfabric"
        if p.exists():
            return str(p)
    raise RuntimeError("no kvfabric binary: cargo build --release -p kvfabric-cli")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Etcd:
    """A single-member etcd on loopback with a temporary data directory."""

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="kvfabric-etcd-")
        client, peer = free_port(), free_port()
        self.endpoint = f"http://127.0.0.1:{client}"
        self.proc = subprocess.Popen(
            [
                shutil.which("etcd") or "/usr/bin/etcd",
                "--data-dir",
                self.dir,
                "--listen-client-urls",
                self.endpoint,
                "--advertise-client-urls",
                self.endpoint,
                "--listen-peer-urls",
                f"http://127.0.0.1:{peer}",
                "--initial-advertise-peer-urls",
                f"http://127.0.0.1:{peer}",
                "--initial-cluster",
                f"default=http://127.0.0.1:{peer}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=open(os.path.join(self.dir, "etcd.log"), "w"),  # noqa: SIM115
        )
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", client), timeout=0.5):
                    return
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError("etcd did not start")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


class Agent:
    """``kvfabric agent`` as a process; ``socket_dir`` is what workers connect to."""

    def __init__(
        self,
        name: str = "agent-0",
        etcd: str | None = None,
        extra: list[str] | None = None,
        socket_dir: str | None = None,
        lease_ttl_secs: int | None = None,
    ) -> None:
        """``lease_ttl_secs``: None runs the agent's default (10 s): a shorter lease is lost
        while real vLLM servers load this machine's two cores, and with it the agent's
        entries until it re-registers."""
        self.name = name
        self.etcd = etcd
        self.lease_ttl_secs = lease_ttl_secs
        self.extra = list(extra or [])
        self.socket_dir = socket_dir or tempfile.mkdtemp(prefix="kvfabric-sock-")
        self.proc: subprocess.Popen[str] | None = None
        self.ready: dict = {}
        self.start()

    def start(self) -> None:
        args = [
            kvfabric_bin(),
            "agent",
            "--name",
            self.name,
            "--fabric",
            "pytest",
            "--socket-dir",
            self.socket_dir,
            "--grpc-addr",
            "127.0.0.1:0",
            "--data-addr",
            "127.0.0.1:0",
            "--metrics-addr",
            "127.0.0.1:0",
            "--advertise-addr",
            "127.0.0.1",
            "--grace-secs",
            "2",
            *self.extra,
        ]
        if self.etcd:
            args += ["--etcd-endpoints", self.etcd]
            if self.lease_ttl_secs is not None:
                args += ["--lease-ttl-secs", str(self.lease_ttl_secs)]
        log = open(os.path.join(self.socket_dir, f"{self.name}.log"), "a")  # noqa: SIM115
        env = dict(os.environ, KVFABRIC_LOG=os.environ.get("KVFABRIC_LOG", "info"))
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
        line: list[str] = []
        reader = threading.Thread(target=lambda: line.append(self.proc.stdout.readline()))
        reader.daemon = True
        reader.start()
        reader.join(30)
        try:
            self.ready = json.loads(line[0]) if line else {}
        except json.JSONDecodeError:
            self.ready = {}
        if not self.ready:
            self.kill()
            raise RuntimeError(f"agent {self.name} did not start: {self.log()[-2000:]}")

    def log(self) -> str:
        try:
            return Path(self.socket_dir, f"{self.name}.log").read_text()
        except OSError:
            return ""

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def terminate(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.kill()
        self.proc = None

    def restart(self) -> None:
        self.kill()
        self.start()
