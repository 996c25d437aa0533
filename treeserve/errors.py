"""Errors that carry their gRPC status code. Raise them anywhere below a servicer; the servicer
boundary (`treeserve.server.grpc_errors`) turns them into the status with the same message."""
from __future__ import annotations

import grpc

from treeserve.tree import TreeError


class ServeError(Exception):
    code: grpc.StatusCode = grpc.StatusCode.INTERNAL


class InvalidArgument(ServeError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(ServeError):
    code = grpc.StatusCode.NOT_FOUND


class FailedPrecondition(ServeError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhausted(ServeError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unauthenticated(ServeError):
    code = grpc.StatusCode.UNAUTHENTICATED


class Unavailable(ServeError):
    code = grpc.StatusCode.UNAVAILABLE


class Unimplemented(ServeError):
    code = grpc.StatusCode.UNIMPLEMENTED


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and message a client should see for `exc`."""
    if isinstance(exc, ServeError):
        return exc.code, str(exc)
    if isinstance(exc, TreeError):
        return grpc.StatusCode.INVALID_ARGUMENT, f"malformed tree: {exc}"
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"


def item_error(exc: BaseException):
    """A per-item error message for batched replies."""
    from treeserve.v1 import treeserve_pb2 as pb

    code, message = status_of(exc)
    return pb.ItemError(code=code.value[0], message=message)
