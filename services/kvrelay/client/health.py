"""The `grpc.health.v1` pieces both clients use: the request and the verdict."""

from __future__ import annotations

from grpc_health.v1 import health_pb2

__all__ = ["HEALTH_TIMEOUT", "health_request", "is_serving"]

HEALTH_TIMEOUT = 5.0  # a probe must answer promptly even when the client has no deadline


def health_request(service: str) -> health_pb2.HealthCheckRequest:
    return health_pb2.HealthCheckRequest(service=service)


def is_serving(response: health_pb2.HealthCheckResponse) -> bool:
    return response.status == health_pb2.HealthCheckResponse.SERVING
