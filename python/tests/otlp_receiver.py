"""A real OTLP/gRPC trace receiver inside the test process: it keeps the spans agents export."""

from __future__ import annotations

import threading
import time
from concurrent import futures

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


class _Service(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, spans: list, cond: threading.Condition) -> None:
        self.spans = spans
        self.cond = cond

    def Export(self, request, context):  # noqa: N802 (gRPC's name)
        with self.cond:
            for rs in request.resource_spans:
                for ss in rs.scope_spans:
                    self.spans.extend(ss.spans)
            self.cond.notify_all()
        return trace_service_pb2.ExportTraceServiceResponse()


class Receiver:
    def __init__(self) -> None:
        self.spans: list = []
        self.cond = threading.Condition()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(
            _Service(self.spans, self.cond), self.server
        )
        port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()
        self.endpoint = f"http://127.0.0.1:{port}"

    def wait_for(self, name: str, timeout: float):
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                for s in self.spans:
                    if s.name == name:
                        return s
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no span {name!r}; got {[s.name for s in self.spans]}")
                self.cond.wait(left)

    def stop(self) -> None:
        self.server.stop(0)
