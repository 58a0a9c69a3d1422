"""The KVFABRIC backend inside the real ``nixl`` wheel from PyPI: NIXL agents on two nodes' kvfabric
agents (etcd, a fabric token) register memory, load each other's metadata, read, write, repost
and notify through NIXL's own Python API, every byte checked; what fails comes back as a NIXL
error, never a hang."""

from __future__ import annotations

import mmap
import os
import time

import numpy as np
import pytest
from fabric import Agent, Etcd

from kvfabric.nixl import NixlMismatch, plugin_dir

# Before NIXL's plugin manager first looks (it reads the variable once per process).
os.environ["NIXL_PLUGIN_DIR"] = str(plugin_dir())
from nixl import _api as nixl_api  # noqa: E402

TOKEN = ["--peer-token", "pytest-nixl-token-0123456789"]
BLOCK = 16 << 10
DEADLINE = 20.0


@pytest.fixture(scope="module")
def nodes():
    e = Etcd()
    agents = [
        Agent("node-p", etcd=e.endpoint, extra=TOKEN),
        Agent("node-d", etcd=e.endpoint, extra=TOKEN),
        Agent("node-x", etcd=e.endpoint, extra=["--peer-token", "another-fabric-token-987654"]),
    ]
    yield e, agents
    for a in agents:
        a.kill()
    e.stop()


def nixl_agent(name: str, node: Agent, by_param: bool = False):
    """A NIXL agent whose KVFABRIC backend talks to ``node``: through the backend parameter,
    or (as vLLM's NixlConnector creates it) through ``KVFABRIC_SOCKET_DIR``."""
    if by_param:
        a = nixl_api.nixl_agent(name, nixl_api.nixl_agent_config(backends=[]))
        a.create_backend("KVFABRIC", {"socket_dir": node.socket_dir})
        return a
    os.environ["KVFABRIC_SOCKET_DIR"] = node.socket_dir
    try:
        return nixl_api.nixl_agent(name, nixl_api.nixl_agent_config(backends=["KVFABRIC"]))
    finally:
        del os.environ["KVFABRIC_SOCKET_DIR"]


def register(agent, *arrays: np.ndarray) -> None:
    descs = [(a.ctypes.data, a.nbytes, 0, "") for a in arrays]
    agent.register_memory(agent.get_reg_descs(descs, "DRAM"))


def blocks(a: np.ndarray, ids) -> object:
    return [(a.ctypes.data + i * BLOCK, BLOCK, 0) for i in ids]


def wait_done(agent, handle) -> str:
    end = time.monotonic() + DEADLINE
    while time.monotonic() < end:
        try:
            state = agent.check_xfer_state(handle)
        except Exception as e:  # NIXL's binding raises the error code the backend answered
            if "NIXL_ERR" not in str(e):
                raise
            return "ERR"
        if state != "PROC":
            return state
        time.sleep(0.001)
    return "PROC"


def wait_notifs(agent, count: int) -> dict[str, list[bytes]]:
    got: dict[str, list[bytes]] = {}
    end = time.monotonic() + DEADLINE
    while time.monotonic() < end and sum(len(v) for v in got.values()) < count:
        for k, v in agent.get_new_notifs().items():
            got.setdefault(k, []).extend(v)
        time.sleep(0.005)
    return got


def own_pages(n: int) -> np.ndarray:
    """``n`` zero bytes on pages of their own, as large allocations (KV caches) are: memory on
    malloc's heap, among other objects, is refused."""
    return np.frombuffer(mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS), np.uint8)


def rng_bytes(rng: np.random.Generator, n: int) -> np.ndarray:
    out = own_pages(n)
    out[:] = rng.integers(0, 256, size=n, dtype=np.uint8)
    return out


def test_reads_writes_reposts_and_notifies_between_two_nodes(nodes):
    _, (node_p, node_d, _) = nodes
    rng = np.random.default_rng(7)
    p = nixl_agent("prefill-0", node_p)
    d = nixl_agent("decode-0", node_d, by_param=True)
    # Two regions on the prefill, one not page-aligned (a view 100 bytes into its array).
    src_a = rng_bytes(rng, 64 * BLOCK)
    backing = rng_bytes(rng, 32 * BLOCK + 100)
    src_b = backing[100:]
    dst = own_pages(96 * BLOCK)
    register(p, src_a, src_b)
    register(d, dst)
    assert d.add_remote_agent(p.get_agent_metadata()) == b"prefill-0"

    # Every block of both regions into a random place of dst.
    order = rng.permutation(96)
    remote = blocks(src_a, range(64)) + blocks(src_b, range(32))
    local = blocks(dst, order)
    h = d.initialize_xfer(
        "READ",
        d.get_xfer_descs(local, "DRAM"),
        d.get_xfer_descs(remote, "DRAM"),
        "prefill-0",
        b"req-1:pulled",
    )
    assert d.transfer(h) in ("PROC", "DONE")
    assert wait_done(d, h) == "DONE"
    want = np.concatenate([src_a, src_b]).reshape(96, BLOCK)
    assert np.array_equal(dst.reshape(96, BLOCK)[order], want)
    # The prefill never loaded the decode's metadata, and still hears who sent what.
    assert wait_notifs(p, 1) == {"decode-0": [b"req-1:pulled"]}

    # The same handle again, after the source changed: NIXL reposts what it prepared.
    src_a[:] = rng_bytes(rng, src_a.nbytes)
    src_b[:] = rng_bytes(rng, src_b.nbytes)
    assert d.transfer(h, b"req-1:again") in ("PROC", "DONE")
    assert wait_done(d, h) == "DONE"
    want = np.concatenate([src_a, src_b]).reshape(96, BLOCK)
    assert np.array_equal(dst.reshape(96, BLOCK)[order], want)
    assert wait_notifs(p, 1) == {"decode-0": [b"req-1:again"]}
    d.release_xfer_handle(h)

    # A write the other way: dst's first 32 blocks into src_b, reversed.
    dst[:] = rng_bytes(rng, dst.nbytes)
    head = backing[:100].copy()
    w = d.initialize_xfer(
        "WRITE",
        d.get_xfer_descs(blocks(dst, range(32)), "DRAM"),
        d.get_xfer_descs(blocks(src_b, range(31, -1, -1)), "DRAM"),
        "prefill-0",
    )
    d.transfer(w)
    assert wait_done(d, w) == "DONE"
    assert np.array_equal(src_b.reshape(32, BLOCK)[::-1], dst[: 32 * BLOCK].reshape(32, BLOCK))
    # Bytes around the registered view were not touched.
    assert np.array_equal(backing[:100], head)
    d.release_xfer_handle(w)

    # A notification alone, the other way (the sender loads the receiver's metadata first).
    p.add_remote_agent(d.get_agent_metadata())
    p.send_notif("decode-0", b"hello")
    assert wait_notifs(d, 1) == {"prefill-0": [b"hello"]}


def test_a_stranger_a_dead_agent_and_unknown_peers_are_nixl_errors(nodes, capfd):
    _, (node_p, node_d, node_x) = nodes
    rng = np.random.default_rng(8)
    p = nixl_agent("prefill-1", node_p)
    src = rng_bytes(rng, 16 * BLOCK)
    register(p, src)
    meta = p.get_agent_metadata()

    # An agent of another fabric (another token) gets NIXL's metadata, which names segments
    # and offsets and no key, and reads nothing with it.
    s = nixl_agent("stranger-1", node_x)
    theirs = own_pages(16 * BLOCK)
    register(s, theirs)
    s.add_remote_agent(meta)
    h = s.initialize_xfer(
        "READ",
        s.get_xfer_descs(blocks(theirs, range(16)), "DRAM"),
        s.get_xfer_descs(blocks(src, range(16)), "DRAM"),
        "prefill-1",
    )
    s.transfer(h)
    assert wait_done(s, h) == "ERR"
    assert not theirs.any(), "a stranger's read landed bytes"

    # A peer whose metadata was never loaded.
    d = nixl_agent("decode-1", node_d)
    dst = own_pages(16 * BLOCK)
    register(d, dst)
    with pytest.raises(Exception, match="NIXL_ERR"):
        d.initialize_xfer(
            "READ",
            d.get_xfer_descs(blocks(dst, range(1)), "DRAM"),
            d.get_xfer_descs(blocks(src, range(1)), "DRAM"),
            "nobody",
        )

    # Memory that cannot move into shared memory (a file mapping) is refused at registration.
    path = os.path.join(node_d.socket_dir, "mapped.bin")
    mapped = np.memmap(path, dtype=np.uint8, mode="w+", shape=(4 * BLOCK,))
    with pytest.raises(Exception, match="NIXL_ERR"):
        register(d, mapped)

    # GPU memory that is not (host memory named VRAM; here no CUDA driver either): the plugin
    # answers with an error that says why, and the agent keeps serving.
    capfd.readouterr()
    with pytest.raises(Exception, match="NIXL_ERR"):
        d.register_memory(d.get_reg_descs([(dst.ctypes.data, BLOCK, 0, "")], "VRAM"))
    assert "kvfabric-nixl: registering memory: GPU memory:" in capfd.readouterr().err

    # The prefill's node agent dies: the decode's read ends in an error, well before any
    # transfer deadline, and the decode's agent keeps serving.
    d.add_remote_agent(meta)
    node_p.kill()
    try:
        h = d.initialize_xfer(
            "READ",
            d.get_xfer_descs(blocks(dst, range(16)), "DRAM"),
            d.get_xfer_descs(blocks(src, range(16)), "DRAM"),
            "prefill-1",
        )
        started = time.monotonic()
        d.transfer(h)
        assert wait_done(d, h) == "ERR"
        assert time.monotonic() - started < DEADLINE
        assert not dst.any()
    finally:
        node_p.start()


def test_the_plugin_refuses_a_nixl_it_was_not_built_for(monkeypatch):
    import kvfabric.nixl as kn

    assert (plugin_dir() / kn.PLUGIN).is_file()
    monkeypatch.setattr(kn, "nixl_version", lambda: "1.6.0")
    with pytest.raises(NixlMismatch, match="1.6.0"):
        kn.plugin_dir()


def test_python_m_kvfabric_nixl_prints_the_directory_or_says_why_not(tmp_path):
    import subprocess
    import sys

    run = lambda env: subprocess.run(  # noqa: E731
        [sys.executable, "-m", "kvfabric.nixl"],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        cwd=tmp_path,
    )
    ok = run({})
    assert ok.returncode == 0 and ok.stdout.strip() == str(plugin_dir()), ok.stderr
    missing = run({"KVFABRIC_NIXL_PLUGIN_DIR": str(tmp_path)})
    assert missing.returncode == 1 and "no libplugin_KVFABRIC.so" in missing.stderr
    assert "Traceback" not in missing.stderr


def test_a_process_that_registered_memory_forks_safely(nodes, capfd):
    """Registered pages are shared memory now: a forked child (``preexec_fn``, multiprocessing's
    fork) must still get its own copy of them. The child writes the buffer and churns its heap;
    the parent's bytes stay, and both live on. A small buffer on malloc's heap, among other
    objects that would be shared with children too, is refused, saying why."""
    import subprocess
    import sys

    _, (node_p, _, _) = nodes
    a = nixl_agent("forker-0", node_p)
    capfd.readouterr()
    with pytest.raises(Exception, match="NIXL_ERR"):
        register(a, np.full(1000, 1, dtype=np.uint8))
    assert "malloc's heap" in capfd.readouterr().err
    bufs = [own_pages(1000 + i * 5000) for i in range(4)]
    for i, b in enumerate(bufs):
        b[:] = i
    register(a, *bufs)
    pid = os.fork()
    if pid == 0:
        try:
            junk = [str(i) * 50 for i in range(100_000)]
            for b in bufs:
                b[:] = 0xEE
            os._exit(0 if len(junk) == 100_000 else 1)
        except BaseException:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
    for i, b in enumerate(bufs):
        assert (b == i).all(), f"the child's write reached the parent's buffer {i}"
    # What aborted before: a subprocess with preexec_fn forks and runs Python in the child.
    done = subprocess.run([sys.executable, "-c", "print('ok')"], preexec_fn=lambda: None,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
