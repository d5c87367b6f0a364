"""Typed gRPC wiring for the DRA-side services, by method path.

As `common.kubeletapi.rpc` does for the device-plugin API: handlers and clients are built here
from the full method names, so a servicer is any object with the right methods (a Protocol) and
`mypy --strict` stays meaningful on both sides, with no untyped generated `_grpc` module.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol

import grpc

from common.draapi import healthpb, regpb, v1, v1beta1

REGISTRATION = "pluginregistration.Registration"
DRA_V1 = "k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin"
DRA_V1BETA1 = "k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin"
HEALTH = "v1alpha1.DRAResourceHealth"


def _serialize(message: Any) -> bytes:
    data: bytes = message.SerializeToString()
    return data


def _unary(fn: Callable[[Any, grpc.ServicerContext], Any], req: Any) -> grpc.RpcMethodHandler[Any, Any]:
    return grpc.unary_unary_rpc_method_handler(
        fn, request_deserializer=req.FromString, response_serializer=_serialize
    )


# ---------------------------------------------------------------------------- servicers


class WatcherRegistrationServicer(Protocol):
    def GetInfo(self, request: regpb.InfoRequest, context: grpc.ServicerContext) -> regpb.PluginInfo: ...

    def NotifyRegistrationStatus(
        self, request: regpb.RegistrationStatus, context: grpc.ServicerContext
    ) -> regpb.RegistrationStatusResponse: ...


class DraV1Servicer(Protocol):
    def NodePrepareResources(
        self, request: v1.NodePrepareResourcesRequest, context: grpc.ServicerContext
    ) -> v1.NodePrepareResourcesResponse: ...

    def NodeUnprepareResources(
        self, request: v1.NodeUnprepareResourcesRequest, context: grpc.ServicerContext
    ) -> v1.NodeUnprepareResourcesResponse: ...


class DraV1beta1Servicer(Protocol):
    def NodePrepareResources(
        self, request: v1beta1.NodePrepareResourcesRequest, context: grpc.ServicerContext
    ) -> v1beta1.NodePrepareResourcesResponse: ...

    def NodeUnprepareResources(
        self, request: v1beta1.NodeUnprepareResourcesRequest, context: grpc.ServicerContext
    ) -> v1beta1.NodeUnprepareResourcesResponse: ...


class HealthServicer(Protocol):
    def NodeWatchResources(
        self, request: healthpb.NodeWatchResourcesRequest, context: grpc.ServicerContext
    ) -> Iterator[healthpb.NodeWatchResourcesResponse]: ...


def registration_handler(servicer: WatcherRegistrationServicer) -> grpc.GenericRpcHandler[Any, Any]:
    """Serves `pluginregistration.Registration` from `servicer`."""
    return grpc.method_handlers_generic_handler(
        REGISTRATION,
        {
            "GetInfo": _unary(servicer.GetInfo, regpb.InfoRequest),
            "NotifyRegistrationStatus": _unary(servicer.NotifyRegistrationStatus, regpb.RegistrationStatus),
        },
    )


def dra_v1_handler(servicer: DraV1Servicer) -> grpc.GenericRpcHandler[Any, Any]:
    """Serves `k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin` from `servicer`."""
    return grpc.method_handlers_generic_handler(
        DRA_V1,
        {
            "NodePrepareResources": _unary(servicer.NodePrepareResources, v1.NodePrepareResourcesRequest),
            "NodeUnprepareResources": _unary(
                servicer.NodeUnprepareResources, v1.NodeUnprepareResourcesRequest
            ),
        },
    )


def dra_v1beta1_handler(servicer: DraV1beta1Servicer) -> grpc.GenericRpcHandler[Any, Any]:
    """Serves `k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin` from `servicer`."""
    return grpc.method_handlers_generic_handler(
        DRA_V1BETA1,
        {
            "NodePrepareResources": _unary(
                servicer.NodePrepareResources, v1beta1.NodePrepareResourcesRequest
            ),
            "NodeUnprepareResources": _unary(
                servicer.NodeUnprepareResources, v1beta1.NodeUnprepareResourcesRequest
            ),
        },
    )


def health_handler(servicer: HealthServicer) -> grpc.GenericRpcHandler[Any, Any]:
    """Serves `v1alpha1.DRAResourceHealth` from `servicer`."""
    return grpc.method_handlers_generic_handler(
        HEALTH,
        {
            "NodeWatchResources": grpc.unary_stream_rpc_method_handler(
                servicer.NodeWatchResources,
                request_deserializer=healthpb.NodeWatchResourcesRequest.FromString,
                response_serializer=_serialize,
            )
        },
    )


# ---------------------------------------------------------------------------- clients (the kubelet's side)


class WatcherRegistrationClient:
    """Calls a plugin's registration socket, as the kubelet's plugin watcher does."""

    def __init__(self, channel: grpc.Channel) -> None:
        base = f"/{REGISTRATION}/"
        self.GetInfo: grpc.UnaryUnaryMultiCallable[regpb.InfoRequest, regpb.PluginInfo] = channel.unary_unary(
            base + "GetInfo", request_serializer=_serialize, response_deserializer=regpb.PluginInfo.FromString
        )
        self.NotifyRegistrationStatus: grpc.UnaryUnaryMultiCallable[
            regpb.RegistrationStatus, regpb.RegistrationStatusResponse
        ] = channel.unary_unary(
            base + "NotifyRegistrationStatus",
            request_serializer=_serialize,
            response_deserializer=regpb.RegistrationStatusResponse.FromString,
        )


class DraV1Client:
    """Calls a DRA plugin's v1 service, as a kubelet that chose "v1.DRAPlugin" does."""

    def __init__(self, channel: grpc.Channel) -> None:
        base = f"/{DRA_V1}/"
        self.NodePrepareResources: grpc.UnaryUnaryMultiCallable[
            v1.NodePrepareResourcesRequest, v1.NodePrepareResourcesResponse
        ] = channel.unary_unary(
            base + "NodePrepareResources",
            request_serializer=_serialize,
            response_deserializer=v1.NodePrepareResourcesResponse.FromString,
        )
        self.NodeUnprepareResources: grpc.UnaryUnaryMultiCallable[
            v1.NodeUnprepareResourcesRequest, v1.NodeUnprepareResourcesResponse
        ] = channel.unary_unary(
            base + "NodeUnprepareResources",
            request_serializer=_serialize,
            response_deserializer=v1.NodeUnprepareResourcesResponse.FromString,
        )


class DraV1beta1Client:
    """Calls a DRA plugin's v1beta1 service, as a kubelet that chose "v1beta1.DRAPlugin" does."""

    def __init__(self, channel: grpc.Channel) -> None:
        base = f"/{DRA_V1BETA1}/"
        self.NodePrepareResources: grpc.UnaryUnaryMultiCallable[
            v1beta1.NodePrepareResourcesRequest, v1beta1.NodePrepareResourcesResponse
        ] = channel.unary_unary(
            base + "NodePrepareResources",
            request_serializer=_serialize,
            response_deserializer=v1beta1.NodePrepareResourcesResponse.FromString,
        )
        self.NodeUnprepareResources: grpc.UnaryUnaryMultiCallable[
            v1beta1.NodeUnprepareResourcesRequest, v1beta1.NodeUnprepareResourcesResponse
        ] = channel.unary_unary(
            base + "NodeUnprepareResources",
            request_serializer=_serialize,
            response_deserializer=v1beta1.NodeUnprepareResourcesResponse.FromString,
        )


class HealthClient:
    """Opens a plugin's NodeWatchResources stream, as a kubelet with ResourceHealthStatus does."""

    def __init__(self, channel: grpc.Channel) -> None:
        self.NodeWatchResources: grpc.UnaryStreamMultiCallable[
            healthpb.NodeWatchResourcesRequest, healthpb.NodeWatchResourcesResponse
        ] = channel.unary_stream(
            f"/{HEALTH}/NodeWatchResources",
            request_serializer=_serialize,
            response_deserializer=healthpb.NodeWatchResourcesResponse.FromString,
        )
