"""`python -m peers run`: for each path and block size, kvfabric's row (`kvfabric bench --json`)
and each peer's on exactly that work, one after the other in the same job; JSON lines into the
output directory and one table last. A peer that fails prints its error and the table goes on."""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import re
import secrets
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

from . import fabric, table
from .drivers import ON_KVFABRIC
from .errors import Kind, PeerError
from .fabric import in_namespace
from .work import Shape

LATENCY_BLOCK = 4096
# A progress bar's line (bench/peers' tqdm format), left out of error messages.
_BAR = re.compile(r"\d+\.\d/\d+\.\d s\s*$")
# The engines' own logs at warnings and up (NIXL logs to stdout, Mooncake's glog to stderr);
# values already in the environment win.
QUIET = {
    k: v
    for k, v in {"NIXL_LOG_LEVEL": "WARN", "GLOG_minloglevel": "1", "UCX_LOG_LEVEL": "warn"}.items()
    if k not in os.environ
}


@dataclasses.dataclass(frozen=True)
class PathSpec:
    """Where the target and the initiator run and how they reach each other."""

    name: str
    transport: str  # tcp, shm or ipc (for the peers)
    kvfabric_transport: str  # kvfabric bench --transport
    server_ns: str | None
    client_ns: str | None
    server_host: str
    client_host: str
    device: int | None


def path_specs(
    names: list[str], netns: tuple[str, str], ips: tuple[str, str], device: int | None
) -> list[PathSpec]:
    lo = "127.0.0.1"
    known = {
        "loopback": PathSpec("loopback", "tcp", "tcp", None, None, lo, lo, None),
        "veth": PathSpec("veth", "tcp", "tcp", netns[1], netns[0], ips[1], ips[0], None),
        "shm": PathSpec("shm", "shm", "shm", None, None, lo, lo, None),
        # One GPU, two processes: the same GPU through CUDA IPC, and GPU memory over tcp.
        "ipc": PathSpec("ipc", "ipc", "cuda-ipc", None, None, lo, lo, device),
        "gpu-tcp": PathSpec("gpu-tcp", "tcp", "tcp", None, None, lo, lo, device),
    }
    out = []
    for n in names:
        if n not in known:
            raise PeerError(Kind.CONFIG, "paths", f"{n!r} is not one of {', '.join(known)}")
        spec = known[n]
        if n in ("ipc", "gpu-tcp") and device is None:
            raise PeerError(Kind.CONFIG, "paths", f"{n} needs --device (a GPU)")
        out.append(spec)
    return out


class Proc:
    """A child in its own process group (so `ip netns exec` and what it runs end together);
    stderr is passed through and its tail kept for error rows."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        self.p = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            env=env,
            text=True,
            bufsize=1,
            start_new_session=True,
        )
        self.tail: collections.deque[str] = collections.deque(maxlen=12)
        assert self.p.stderr is not None
        # Raw bytes: progress bars redraw with carriage returns, which text mode would turn
        # into new lines.
        self.t = threading.Thread(
            target=self._pass_stderr, args=(self.p.stderr.fileno(),), daemon=True
        )
        self.t.start()

    def _pass_stderr(self, fd: int) -> None:
        partial = b""
        while chunk := os.read(fd, 1 << 16):
            sys.stderr.buffer.write(chunk)
            sys.stderr.buffer.flush()
            *lines, partial = (partial + chunk).replace(b"\r", b"\n").split(b"\n")
            self.tail.extend(x.decode(errors="replace")[-300:] for x in lines if x.strip())

    def _drain(self, stream: IO[str]) -> None:
        for line in stream:
            self.tail.append(line.rstrip()[-300:])

    def announcement(self, timeout: float) -> dict[str, Any] | None:
        """The first JSON object the child prints within `timeout` seconds (engines log to
        stdout too)."""
        assert self.p.stdout is not None
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            ready, _, _ = select.select([self.p.stdout], [], [], left)
            if not ready:
                break
            line = self.p.stdout.readline()
            if not line:
                break
            if line.startswith("{"):
                try:
                    got = json.loads(line)
                except ValueError:
                    continue
                if isinstance(got, dict) and "control" in got:
                    # Whatever it prints later is drained, or a full pipe would stall it.
                    threading.Thread(target=self._drain, args=(self.p.stdout,), daemon=True).start()
                    return got
        return None

    def objects(self, timeout: float) -> list[dict[str, Any]]:
        """Every JSON object printed on stdout until exit (other lines are engine logs); the
        group is killed past `timeout` seconds."""
        assert self.p.stdout is not None
        timer = threading.Timer(timeout, self.stop)
        timer.start()
        try:
            out = []
            for line in self.p.stdout:
                if line.startswith("{"):
                    try:
                        got = json.loads(line)
                    except ValueError:
                        continue
                    if isinstance(got, dict):
                        out.append(got)
            return out
        finally:
            timer.cancel()
            self.p.wait()
            self.t.join(timeout=5)

    def why(self) -> str:
        code = self.p.poll()
        said = " | ".join(x.strip() for x in self.tail if x.strip() and not _BAR.search(x))[-600:]
        return f"exited with {code}: {said}" if code else f"ended early: {said}"

    def stop(self) -> None:
        if self.p.poll() is not None:
            return
        try:
            os.killpg(self.p.pid, signal.SIGTERM)
            self.p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(self.p.pid, signal.SIGKILL)
            self.p.wait()
        except ProcessLookupError:
            pass


@dataclasses.dataclass(frozen=True)
class Plan:
    blocks: list[int]
    ops: list[str]
    pool_bytes: int
    batch_bytes: int
    inflight: int
    seconds: float
    latency: bool

    def shapes(self) -> list[Shape]:
        out = [
            Shape(op, self.pool_bytes, b, self.batch_bytes // b, self.inflight, self.seconds)
            for b in self.blocks
            for op in self.ops
        ]
        if self.latency:
            out.append(Shape("read", self.pool_bytes, LATENCY_BLOCK, 1, 1, self.seconds))
        return out


def _row_base(engine: str, path: PathSpec, shape: Shape) -> dict[str, Any]:
    return {
        "engine": engine,
        "path": path.name,
        "transport": path.transport,
        "location": "host" if path.device is None else f"cuda:{path.device}",
        "op": shape.op,
        "block_size": shape.block_size,
        "blocks_per_batch": shape.per_batch,
        "inflight": shape.inflight,
        "pool_bytes": shape.pool_bytes,
        "verified": False,
    }


def _kvfabric_version(binary: str) -> str:
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30)
        return out.stdout.strip().split()[-1] if out.returncode == 0 and out.stdout else "?"
    except OSError:
        return "?"


def kvfabric_rows(binary: str, path: PathSpec, plan: Plan) -> list[dict[str, Any]]:
    env = dict(os.environ)
    version = _kvfabric_version(binary)
    location = (
        []
        if path.device is None
        else ["--location", f"cuda:{path.device}", "--peer-location", f"cuda:{path.device}"]
    )
    serve = [binary, "bench", "--serve", f"{path.server_host}:0"]
    server = Proc(in_namespace(path.server_ns, serve), env)
    rows = []
    try:
        announced = server.announcement(60)
        control = str(announced["control"]) if announced else None
        for shape in plan.shapes():
            base = {**_row_base("kvfabric", path, shape), "version": version}
            if control is None:
                rows.append({**base, "error": f"kvfabric target {server.why()}"})
                continue
            argv = [
                binary,
                "bench",
                "--json",
                "--connect",
                control,
                "--transport",
                path.kvfabric_transport,
                "--op",
                shape.op,
                "--block-size",
                str(shape.block_size),
                "--blocks-per-batch",
                str(shape.per_batch),
                "--concurrency",
                str(shape.inflight),
                "--pool-bytes",
                str(shape.pool_bytes),
                "--duration",
                str(shape.seconds),
                *location,
            ]
            child = Proc(in_namespace(path.client_ns, argv), env)
            got = child.objects(timeout=4 * shape.seconds + 180)
            if got:
                r = got[-1]
                rows.append(
                    {
                        **base,
                        **{
                            k: r[k]
                            for k in (
                                "batches",
                                "bytes",
                                "gbps",
                                "p50_us",
                                "p99_us",
                                "verified",
                                "ceiling_name",
                                "ceiling_gbps",
                                "ceiling_p50_us",
                                "ratio",
                                "selection",
                            )
                            if k in r
                        },
                    }
                )
            else:
                rows.append({**base, "error": f"kvfabric bench {child.why()}"})
    finally:
        server.stop()
    return rows


def row_timeout(shape: Shape) -> float:
    """How long one peer row may take: its timed seconds, warm-up, fill and check of two pools."""
    return 3 * shape.seconds + 60 + 30 * shape.pool_bytes / (1 << 30)


class PeerTarget:
    """A peer's target process for one path; started again after a row that did not end
    cleanly (its engine may still hold that row's transfers)."""

    def __init__(
        self, engine: str, path: PathSpec, env: dict[str, str], me: list[str], link: list[str]
    ) -> None:
        self.argv = in_namespace(path.server_ns, [*me, "serve", *link, "--host", path.server_host])
        self.env = env
        self.engine = engine
        self.proc: Proc | None = None
        self.control: str | None = None
        self.refused = ""

    def address(self) -> tuple[str | None, str]:
        """The target's control address, or None and why; a target that could not start is not
        started again for the path's other rows."""
        if self.refused:
            return None, self.refused
        if self.proc is None:
            self.proc = Proc(self.argv, self.env)
            announced = self.proc.announcement(120)
            if announced is None:
                self.proc.stop()
                self.refused = f"{self.engine} target {self.proc.why()}"
                self.proc = None
                return None, self.refused
            self.control = str(announced["control"])
        return self.control, ""

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()
        self.proc = None
        self.control = None


def peer_rows(
    engine: str,
    path: PathSpec,
    plan: Plan,
    progress: bool,
    sides: tuple[dict[str, str], dict[str, str]] = ({}, {}),
) -> list[dict[str, Any]]:
    """One initiator process per row, so an engine that stalls or crashes costs that row only.
    `sides`: more environment for the target and for the initiator."""
    token = secrets.token_hex(16)
    here = str(Path(__file__).resolve().parent.parent)
    env = {
        **os.environ,
        **QUIET,
        "KVF_PEERS_TOKEN": token,
        "PYTHONPATH": os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p),
    }
    me = [sys.executable, "-m", "peers"]
    link = ["--engine", engine, "--transport", path.transport]
    if path.device is not None:
        link += ["--device", str(path.device)]
    target = PeerTarget(engine, path, {**env, **sides[0]}, me, link)
    rows = []
    try:
        for shape in plan.shapes():
            base = _row_base(engine, path, shape)
            control, why = target.address()
            if control is None:
                rows.append({**base, "error": why})
                continue
            argv = [
                *me,
                "drive",
                *link,
                "--host",
                path.client_host,
                "--connect",
                control,
                "--path",
                path.name,
                "--blocks",
                str(shape.block_size),
                "--ops",
                shape.op,
                "--pool-bytes",
                str(shape.pool_bytes),
                "--inflight",
                str(shape.inflight),
                "--batch-bytes",
                str(shape.batch_bytes),
                "--seconds",
                str(shape.seconds),
            ]
            if shape.per_batch == 1 and shape.inflight == 1:
                argv = [
                    *argv[: argv.index("--blocks")],
                    "--latency-only",
                    *argv[argv.index("--pool-bytes") :],
                ]
            if not progress:
                argv.append("--no-progress")
            child = Proc(in_namespace(path.client_ns, argv), {**env, **sides[1]})
            limit = row_timeout(shape)
            got = child.objects(limit)
            if got:
                rows.append(got[-1])
            else:
                killed = child.p.returncode in (-signal.SIGTERM, -signal.SIGKILL)
                late = f"no result within {limit:.0f} s; " if killed else ""
                rows.append({**base, "error": f"{engine} driver {late}{child.why()}"})
            if rows[-1].get("error"):
                target.stop()
    finally:
        target.stop()
    return rows


def on_kvfabric_rows(
    engine: str,
    binary: str | None,
    plugin_dir: Path | None,
    path: PathSpec,
    plan: Plan,
    progress: bool,
) -> list[dict[str, Any]]:
    """A peer engine's rows on kvfabric agents started for the path (NIXL's KVFABRIC backend)."""
    why = ""
    if binary is None:
        why = "needs --kvfabric (the agent binary)"
    elif plugin_dir is None or not (plugin_dir / "libplugin_KVFABRIC.so").is_file():
        why = f"no libplugin_KVFABRIC.so in --nixl-plugin-dir ({plugin_dir})"
    if why:
        return [{**_row_base(engine, path, s), "error": why} for s in plan.shapes()]
    assert binary is not None and plugin_dir is not None
    try:
        with fabric.agents(
            binary,
            (path.server_ns, path.server_host),
            (path.client_ns, path.client_host),
            path.transport,
        ) as (server_env, client_env):
            plugin = {"NIXL_PLUGIN_DIR": str(plugin_dir.resolve())}
            sides = ({**server_env, **plugin}, {**client_env, **plugin})
            return peer_rows(engine, path, plan, progress, sides)
    except PeerError as e:
        return [{**_row_base(engine, path, s), "error": str(e)} for s in plan.shapes()]


def run(
    binary: str | None,
    engines: list[str],
    paths: list[PathSpec],
    plan: Plan,
    out: Path,
    progress: bool,
    plugin_dir: Path | None = None,
) -> list[dict[str, Any]]:
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    with open(out / "rows.jsonl", "w") as sink:
        for path in paths:
            for engine in engines:
                print(f"== {path.name}: {engine}", file=sys.stderr, flush=True)
                if engine == "kvfabric":
                    if binary is None:
                        continue
                    got = kvfabric_rows(binary, path, plan)
                elif engine in ON_KVFABRIC:
                    got = on_kvfabric_rows(engine, binary, plugin_dir, path, plan, progress)
                else:
                    got = peer_rows(engine, path, plan, progress)
                for r in got:
                    sink.write(json.dumps(r) + "\n")
                    sink.flush()
                    if r.get("error"):
                        print(
                            f"   {engine} {path.name} {r['op']} {table.size(r['block_size'])}: "
                            f"{r['error']}",
                            file=sys.stderr,
                            flush=True,
                        )
                rows += got
    text = table.render(rows)
    (out / "table.txt").write_text(text + "\n")
    print(text)
    return rows
