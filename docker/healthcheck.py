#!/usr/bin/env python3
"""Container health check: exit 0 when the gRPC server on localhost:PORT reports SERVING."""
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

port = sys.argv[1] if len(sys.argv) > 1 else "50051"
try:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=3)
    sys.exit(0 if r.status == health_pb2.HealthCheckResponse.SERVING else 1)
except grpc.RpcError:
    sys.exit(1)
