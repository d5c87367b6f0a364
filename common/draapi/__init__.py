"""The kubelet's DRA-side gRPC APIs: generated messages plus typed gRPC glue.

Four APIs, one proto each, written from the kubelet's field lists: the plugin watcher's
registration (`pluginregistration.Registration`: GetInfo, NotifyRegistrationStatus), the
`DRAPlugin` service in its v1 and v1beta1 packages (NodePrepareResources, NodeUnprepareResources)
and the device-health stream (`v1alpha1.DRAResourceHealth`: NodeWatchResources). Their `*_pb2`
modules are made by `generate` (`python -m common.draapi.generate`) and committed; `rpc` wires
servicers and clients by method path with full typing. The DRA worker serves these (worker/dra/),
the DRA kubelet stand-in calls them (supervisor/sim/drakubelet.py). Imports nothing of
`supervisor/` or `worker/`.
"""

from common.draapi import dra_v1_pb2 as v1
from common.draapi import dra_v1beta1_pb2 as v1beta1
from common.draapi import health_pb2 as healthpb
from common.draapi import registration_pb2 as regpb
from common.socketnames import DRA_SERVICE_SOCKET_NAME, dra_registration_socket_name

PLUGIN_TYPE = "DRAPlugin"  # PluginInfo.type of a DRA kubelet plugin (pluginregistration/v1 constants)
# What PluginInfo.supported_versions lists: "<gRPC package's last part>.<service>". The kubelet
# takes the first one it knows, so the newest comes first.
V1_SERVICE = "v1.DRAPlugin"
V1BETA1_SERVICE = "v1beta1.DRAPlugin"
HEALTH_SERVICE = "v1alpha1.DRAResourceHealth"
DEFAULT_PLUGINS_DIR = "/var/lib/kubelet/plugins"
DEFAULT_REGISTRY_DIR = "/var/lib/kubelet/plugins_registry"
# In <plugins dir>/<driver>/ and the registry dir (common.socketnames, where the supervisor reads them).
SERVICE_SOCKET_NAME = DRA_SERVICE_SOCKET_NAME
registration_socket_name = dra_registration_socket_name


__all__ = [
    "DEFAULT_PLUGINS_DIR",
    "DEFAULT_REGISTRY_DIR",
    "HEALTH_SERVICE",
    "PLUGIN_TYPE",
    "SERVICE_SOCKET_NAME",
    "V1BETA1_SERVICE",
    "V1_SERVICE",
    "healthpb",
    "registration_socket_name",
    "regpb",
    "v1",
    "v1beta1",
]
