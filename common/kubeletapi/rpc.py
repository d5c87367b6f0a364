"""Typed gRPC wiring for the v1beta1 services, by method path.

The generated `api_pb2_grpc` module is untyped; building handlers and stubs here from the method
paths keeps `mypy --strict` meaningful across the code that serves and calls the API, and lets a
servicer be any object with the right methods (a Protocol), with no generated base class.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol

import grpc

from common.kubeletapi import api_pb2 as pb

REGISTRATION_SERVICE = "v1beta1.Registration"
DEVICE_PLUGIN_SERVICE = "v1beta1.DevicePlugin"


class DevicePluginServicer(Protocol):
    def GetDevicePluginOptions(
        self, request: pb.Empty, context: grpc.ServicerContext
    ) -> pb.DevicePluginOptions: ...

    def ListAndWatch(
        self, request: pb.Empty, context: grpc.ServicerContext
    ) -> Iterator[pb.ListAndWatchResponse]: ...

    def GetPreferredAllocation(
        self, request: pb.PreferredAllocationRequest, context: grpc.ServicerContext
    ) -> pb.PreferredAllocationResponse: ...

    def Allocate(self, request: pb.AllocateRequest, context: grpc.ServicerContext) -> pb.AllocateResponse: ...

    def PreStartContainer(
        self, request: pb.PreStartContainerRequest, context: grpc.ServicerContext
    ) -> pb.PreStartContainerResponse: ...


class RegistrationServicer(Protocol):
    def Register(self, request: pb.RegisterRequest, context: grpc.ServicerContext) -> pb.Empty: ...


def _unary(fn: Callable[[Any, grpc.ServicerContext], Any], req: Any) -> grpc.RpcMethodHandler[Any, Any]:
    return grpc.unary_unary_rpc_method_handler(
        fn, request_deserializer=req.FromString, response_serializer=_serialize
    )


def _serialize(message: Any) -> bytes:
    data: bytes = message.SerializeToString()
    return data


def device_plugin_handler(servicer: DevicePluginServicer) -> grpc.GenericRpcHandler[Any, Any]:
    """The generic handler that serves `v1beta1.DevicePlugin` from `servicer`."""
    handlers = {
        "GetDevicePluginOptions": _unary(servicer.GetDevicePluginOptions, pb.Empty),
        "ListAndWatch": grpc.unary_stream_rpc_method_handler(
            servicer.ListAndWatch, request_deserializer=pb.Empty.FromString, response_serializer=_serialize
        ),
        "GetPreferredAllocation": _unary(servicer.GetPreferredAllocation, pb.PreferredAllocationRequest),
        "Allocate": _unary(servicer.Allocate, pb.AllocateRequest),
        "PreStartContainer": _unary(servicer.PreStartContainer, pb.PreStartContainerRequest),
    }
    return grpc.method_handlers_generic_handler(DEVICE_PLUGIN_SERVICE, handlers)


def registration_handler(servicer: RegistrationServicer) -> grpc.GenericRpcHandler[Any, Any]:
    """The generic handler that serves `v1beta1.Registration` from `servicer`."""
    return grpc.method_handlers_generic_handler(
        REGISTRATION_SERVICE, {"Register": _unary(servicer.Register, pb.RegisterRequest)}
    )


def unix_target(path: str) -> str:
    """The gRPC target for a unix socket path (absolute paths give `unix:///...`)."""
    return f"unix://{path}" if path.startswith("/") else f"unix:{path}"


class DevicePluginClient:
    """Calls a device plugin's `v1beta1.DevicePlugin` service, as the kubelet does."""

    def __init__(self, channel: grpc.Channel) -> None:
        base = f"/{DEVICE_PLUGIN_SERVICE}/"
        self.GetDevicePluginOptions: grpc.UnaryUnaryMultiCallable[pb.Empty, pb.DevicePluginOptions] = (
            channel.unary_unary(
                base + "GetDevicePluginOptions",
                request_serializer=_serialize,
                response_deserializer=pb.DevicePluginOptions.FromString,
            )
        )
        self.ListAndWatch: grpc.UnaryStreamMultiCallable[pb.Empty, pb.ListAndWatchResponse] = (
            channel.unary_stream(
                base + "ListAndWatch",
                request_serializer=_serialize,
                response_deserializer=pb.ListAndWatchResponse.FromString,
            )
        )
        self.GetPreferredAllocation: grpc.UnaryUnaryMultiCallable[
            pb.PreferredAllocationRequest, pb.PreferredAllocationResponse
        ] = channel.unary_unary(
            base + "GetPreferredAllocation",
            request_serializer=_serialize,
            response_deserializer=pb.PreferredAllocationResponse.FromString,
        )
        self.Allocate: grpc.UnaryUnaryMultiCallable[pb.AllocateRequest, pb.AllocateResponse] = (
            channel.unary_unary(
                base + "Allocate",
                request_serializer=_serialize,
                response_deserializer=pb.AllocateResponse.FromString,
            )
        )
        self.PreStartContainer: grpc.UnaryUnaryMultiCallable[
            pb.PreStartContainerRequest, pb.PreStartContainerResponse
        ] = channel.unary_unary(
            base + "PreStartContainer",
            request_serializer=_serialize,
            response_deserializer=pb.PreStartContainerResponse.FromString,
        )


class RegistrationClient:
    """Calls the kubelet's `v1beta1.Registration` service, as a plugin does."""

    def __init__(self, channel: grpc.Channel) -> None:
        self.Register: grpc.UnaryUnaryMultiCallable[pb.RegisterRequest, pb.Empty] = channel.unary_unary(
            f"/{REGISTRATION_SERVICE}/Register",
            request_serializer=_serialize,
            response_deserializer=pb.Empty.FromString,
        )
