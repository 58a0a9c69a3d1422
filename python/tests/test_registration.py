"""The connector's :class:`Registration` keeper against a real agent: it registers a segment
again when the agent lost it (restarted), and only then. A probe that fails for a reason that
says nothing about the registration (a busy agent, a lease being renewed, a probe answered from
a stale view) never starts a re-registration loop. No vLLM needed."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from fabric import Agent

import kvfabric
from kvfabric import AgentError
from kvfabric.vllm.registration import WORD, Registration

INTERVAL = 0.05


class Scripted:
    """The real client, except that its next probe reads fail with the given codes first."""

    def __init__(self, client: kvfabric.Client) -> None:
        self.client = client
        self.failures: list[str] = []
        self.registers = 0
        self.lock = threading.Lock()

    def fail_probes(self, *codes: str) -> None:
        with self.lock:
            self.failures.extend(codes)

    def read(self, *args: Any, **kwargs: Any) -> Any:
        with self.lock:
            code = self.failures.pop(0) if self.failures else None
        if code is not None:
            raise AgentError(f"Submit: {code} (scripted)", "Submit", code, 0, "scripted")
        return self.client.read(*args, **kwargs)

    def register(self, *args: Any, **kwargs: Any) -> Any:
        with self.lock:
            self.registers += 1
        return self.client.register(*args, **kwargs)

    def deregister(self, *args: Any, **kwargs: Any) -> Any:
        return self.client.deregister(*args, **kwargs)


@pytest.fixture
def keeper(tmp_path):
    agent = Agent(socket_dir=str(tmp_path))
    client = Scripted(kvfabric.Client(tmp_path))
    memory = kvfabric.host_array(4 * WORD)
    r = Registration(client, "w.pp0.tp0", [memory], 77, (0, 0), INTERVAL, 5.0)  # type: ignore[arg-type]
    try:
        yield agent, client, r
    finally:
        r.close()
        agent.kill()


def served(client: Scripted, name: str) -> list[str]:
    return [s["name"] for s in client.client.status()["segments"] if s["name"] == name]


def wait_for(what, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(INTERVAL)


def test_an_agent_that_lost_the_segment_gets_it_registered_again_with_its_key(keeper):
    agent, client, r = keeper
    agent.restart()
    wait_for(lambda: client.registers == 2)
    wait_for(lambda: r.registered())
    assert served(client, "w.pp0.tp0") == ["w.pp0.tp0"]
    time.sleep(10 * INTERVAL)
    assert client.registers == 2, "registered again while served"


@pytest.mark.parametrize(
    "code", ["DEADLINE_EXCEEDED", "UNAVAILABLE", "CANCELLED", "RESOURCE_EXHAUSTED", "INTERNAL"]
)
def test_a_probe_that_fails_for_another_reason_registers_nothing(keeper, code):
    _, client, _ = keeper
    client.fail_probes(*[code] * 5)
    wait_for(lambda: not client.failures)
    time.sleep(5 * INTERVAL)
    assert client.registers == 1


def test_a_stale_not_found_ends_at_the_agents_already_exists(keeper):
    """Seen under load: the probe heard NOT_FOUND while the agent re-registered its lease, the
    agent still served the segment and answered every register with ALREADY_EXISTS, and the
    keeper retried once a second for minutes. It probes again and stops."""
    _, client, r = keeper
    client.fail_probes("NOT_FOUND")
    wait_for(lambda: client.registers >= 2)
    time.sleep(20 * INTERVAL)
    assert client.registers == 2, client.registers
    assert r.registered()
