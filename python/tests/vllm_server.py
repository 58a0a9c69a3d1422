"""A real vLLM OpenAI server as a process (``python -m vllm.entrypoints.openai.api_server``; the
``vllm serve`` entry point looks up a ``vllm`` distribution the CPU wheel does not have), and
the P/D proxy protocol NixlConnector's routers speak, as the tests' router."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from fabric import free_port

BLOCK_SIZE = 32
# How much lower than the agents, etcd and the tests the servers run (see VllmServer).
NICE = 10


class VllmServer:
    def __init__(
        self,
        name: str,
        model: Path,
        logdir: Path,
        kv_role: str | None = None,
        socket_dir: str | None = None,
        extra_config: dict | None = None,
        prefix_caching: bool = True,
        connector: dict | None = None,
        env: dict[str, str | None] | None = None,
        tp: int = 1,
        block_size: int = BLOCK_SIZE,
        kv_bytes: int = 64 << 20,
        args: list[str] | None = None,
        nice: int = NICE,
    ) -> None:
        """``kv_role`` set: with KVFabricConnector on the agent at ``socket_dir``, or with
        another connector (``connector``: the kv-transfer-config fields that differ, e.g.
        ``{"kv_connector": "NixlConnector", "kv_connector_module_path": None, ...}``).
        ``env``: more environment (None: a variable left out). ``tp``: tensor-parallel workers;
        ``kv_bytes``: the KV cache's size (``--kv-cache-memory-bytes``); ``nice``: how much lower
        than everything else the server runs (benchmarks: 0, every connector's threads as the
        engine's)."""
        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = logdir / f"{name}.log"
        args = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model),
            "--served-model-name",
            "tiny",
            "--skip-tokenizer-init",
            "--dtype",
            "float32",
            "--block-size",
            str(block_size),
            "--max-model-len",
            "8192",
            "--max-num-batched-tokens",
            "8192",
            "--kv-cache-memory-bytes",
            str(kv_bytes),
            "--enforce-eager",
            "--seed",
            "0",
            "--enable-prompt-tokens-details",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--tensor-parallel-size",
            str(tp),
            *(args or []),
        ]
        if not prefix_caching:
            args.append("--no-enable-prefix-caching")
        if kv_role:
            config = {
                "kv_connector": "KVFabricConnector",
                "kv_connector_module_path": "kvfabric.vllm",
                "kv_role": kv_role,
                "kv_load_failure_policy": "recompute",
                "engine_id": name,
                "kv_connector_extra_config": {"socket_dir": socket_dir, **(extra_config or {})},
                **(connector or {}),
            }
            config = {k: v for k, v in config.items() if v is not None}
            args += ["--kv-transfer-config", json.dumps(config)]
        extra_env = env
        env = dict(
            os.environ,
            VLLM_CPU_OMP_THREADS_BIND="nobind",
            HF_HUB_OFFLINE="1",
            OMP_NUM_THREADS="1",
            VLLM_LOGGING_LEVEL="INFO",
            # Log lines reach the file as they are written: tests and benchmarks read them.
            PYTHONUNBUFFERED="1",
        )
        for k, v in (extra_env or {}).items():
            if v is None:
                env.pop(k, None)
            else:
                env[k] = v
        self.proc = subprocess.Popen(
            args,
            stdout=open(self.log_path, "w"),  # noqa: SIM115
            stderr=subprocess.STDOUT,
            env=env,
            # A process group (stop() kills the whole server), not a session: with autogroup
            # scheduling (Linux's default) each session competes as one group of equal weight
            # whatever its nice value, and a TP server's workers, which spin while they wait
            # for work, starved the other servers and the agents for 10-40 s on two cores.
            process_group=0,
            # Below the agents, etcd and the test itself, as a node gives the agent DaemonSet
            # CPU of its own: several servers on two cores starved etcd of its keepalives for
            # 10 s at a time and every agent's lease ran out mid-test.
            preexec_fn=lambda: os.nice(nice),
        )

    def wait_ready(self, timeout: float = 420) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited: {self.log()[-3000:]}")
            try:
                urllib.request.urlopen(self.url + "/v1/models", timeout=2).read()
                return
            except (urllib.error.URLError, OSError):
                time.sleep(1)
        raise TimeoutError(f"{self.name} not ready in {timeout} s: {self.log()[-3000:]}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def alive(self) -> bool:
        """Whether the server still answers (its engine not dead)."""
        try:
            urllib.request.urlopen(self.url + "/health", timeout=10).read()
            return True
        except (urllib.error.URLError, OSError):
            return False

    def complete(
        self,
        prompt: list[int],
        max_tokens: int,
        kv_transfer_params: dict | None = None,
        timeout: float = 120,
        cache_salt: str | None = None,
    ) -> dict:
        """``cache_salt``: computed apart from the prefix cache (vLLM hashes blocks with it), so
        the output is the instance's own, from scratch."""
        body = self._body(prompt, max_tokens, kv_transfer_params)
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        req = urllib.request.Request(
            self.url + "/v1/completions",
            json.dumps(body).encode(),
            {"content-type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())

    @staticmethod
    def _body(
        prompt: list[int], max_tokens: int, params: dict | None, stream: bool = False
    ) -> dict:
        body = {
            "model": "tiny",
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
            "stream": stream,
        }
        if params is not None:
            body["kv_transfer_params"] = params
        return body

    def metric(self, name: str, **labels: str) -> float:
        """The sum of the series of ``name`` whose labels include ``labels`` (0 when none: a
        labelled counter has no series until it first counts)."""
        text = urllib.request.urlopen(self.url + "/metrics", timeout=60).read().decode()
        total = 0.0
        for line in text.splitlines():
            m = re.match(rf"^{re.escape(name)}(\{{.*\}})? (\S+)$", line)
            if m and all(f'{k}="{v}"' in (m.group(1) or "") for k, v in labels.items()):
                total += float(m.group(2))
        return total

    def abandon(
        self,
        prompt: list[int],
        max_tokens: int,
        params: dict | None,
        after_s: float,
        hang_up: threading.Event | None = None,
    ):
        """Sends a completion and hangs up ``after_s`` later, or as soon as ``hang_up`` is set
        (a client that disconnects): returns the thread doing it."""

        def run() -> None:
            body = json.dumps(self._body(prompt, max_tokens, params, stream=True)).encode()
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=after_s + 30)
            try:
                conn.request("POST", "/v1/completions", body, {"content-type": "application/json"})
                if hang_up is not None:
                    # A read blocks while the request waits (preempted): shutting the socket
                    # from here ends it at once.
                    threading.Thread(target=cut, args=(conn.sock,), daemon=True).start()
                deadline = time.monotonic() + after_s
                resp = conn.getresponse() if after_s > 0 else None
                while resp is not None and time.monotonic() < deadline:
                    if not resp.read1(64):
                        break
            except (OSError, http.client.HTTPException):
                pass
            finally:
                conn.close()

        def cut(sock) -> None:
            if hang_up.wait(after_s):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

        t = threading.Thread(target=run, daemon=True)
        t.start()
        return t

    def kill(self) -> None:
        """SIGKILL to the server's whole process group (API server, engine core, worker)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()


def nixl_connector(extra_config: dict | None = None) -> dict:
    """VllmServer's arguments for vLLM's own NixlConnector, as vLLM configures it on CPU (host
    KV buffer, a side-channel port of its own): ``connector`` and ``env``."""
    return {
        "connector": {
            "kv_connector": "NixlConnector",
            "kv_connector_module_path": None,
            "kv_buffer_device": "cpu",
            "kv_connector_extra_config": extra_config or {},
        },
        "env": {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())},
    }


def start(*servers: VllmServer, timeout: float = 600) -> None:
    """Waits until every server (started together: they load at the same time) answers."""
    deadline = time.monotonic() + timeout
    for s in servers:
        s.wait_ready(max(1.0, deadline - time.monotonic()))


HITS = "vllm:external_prefix_cache_hits_total"
USAGE = "vllm:kv_cache_usage_perc"


def prompt(n: int, seed: int) -> list[int]:
    """``n`` random token ids of the tiny models' vocabulary."""
    import numpy as np

    return np.random.default_rng(seed).integers(3, 500, n).tolist()


def pulls(server: VllmServer, response: dict) -> int:
    """How many of the server's workers logged a completed pull for this response's request."""
    return server.log().count(f"kvfabric: pulled {response['id']}-")


def trail(server: VllmServer, response: dict) -> str:
    """Why a request was or was not pulled, for an assertion's message: the server's log lines
    that name it or say why something was recomputed, and its kvfabric counters."""
    rid = response["id"]
    lines = [
        line
        for line in server.log().splitlines()
        if rid in line or "recomputed" in line or ("kvfabric" in line and "failed" in line)
    ]
    counters = {
        name: server.metric(f"vllm:kvfabric_{name}_total")
        for name in ("pulls", "pull_failures", "not_pulled", "local_hits")
    }
    return f"{server.name} {counters}\n" + "\n".join(lines[-20:])


def wait_free(server: VllmServer, timeout: float = 60) -> None:
    """Until the server holds no KV blocks and runs nothing."""
    deadline = time.monotonic() + timeout
    while (
        server.metric(USAGE) > 0
        or server.metric("vllm:num_requests_running")
        or server.metric("vllm:num_requests_waiting")
    ):
        assert time.monotonic() < deadline, f"{server.name} still holds blocks or requests"
        time.sleep(0.2)


def tokens(response: dict) -> list[int]:
    return response["choices"][0]["token_ids"]


def cached_tokens(response: dict) -> int:
    details = response["usage"].get("prompt_tokens_details") or {}
    return details.get("cached_tokens") or 0


def prefill(server: VllmServer, prompt: list[int], cache_salt: str | None = None) -> dict:
    """What a P/D router sends the prefill instance; returns the params for the decode one."""
    out = server.complete(
        prompt,
        1,
        {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_host": None,
            "remote_port": None,
        },
        cache_salt=cache_salt,
    )
    return out["kv_transfer_params"]


class Stalls:
    """Gaps in a thread that ticks every 0.1 s: where one is seconds long, the whole machine
    stood still (seen on the 2-core VM with several servers up: 5–28 s, even for a process at
    nice -20), and any deadline inside the fabric may have run out through no fault of its."""

    TICK = 0.1

    def __init__(self) -> None:
        self.gaps: list[tuple[float, float]] = []  # (when it ended, how long)
        self.lock = threading.Lock()
        threading.Thread(target=self._tick, name="stall-watch", daemon=True).start()

    def _tick(self) -> None:
        last = time.monotonic()
        while True:
            time.sleep(self.TICK)
            now = time.monotonic()
            if now - last > 2.0:
                with self.lock:
                    self.gaps.append((now, now - last))
            last = now

    def longest_since(self, t0: float) -> float:
        """The longest stall that ended after ``t0`` (0: none)."""
        with self.lock:
            return max((gap for end, gap in self.gaps if end > t0), default=0.0)


STALLS = Stalls()
