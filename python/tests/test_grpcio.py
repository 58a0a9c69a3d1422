"""A stock grpcio client (what a Python worker links) on the agent's Unix socket, with no channel
options: grpcio sends the socket path, percent-encoded, as ``:authority``, and the agent answers."""

from __future__ import annotations

import os

import grpc

# grpc.health.v1.HealthCheckResponse{status: SERVING}
SERVING = b"\x08\x01"


def test_a_stock_grpcio_channel_on_the_unix_socket_is_answered(agent):
    target = "unix://" + os.path.join(agent.socket_dir, "agent.sock")
    with grpc.insecure_channel(target) as channel:
        check = channel.unary_unary("/grpc.health.v1.Health/Check")
        # Later calls refer to the authority through grpcio's HPACK table.
        for _ in range(3):
            assert check(b"", timeout=10) == SERVING
