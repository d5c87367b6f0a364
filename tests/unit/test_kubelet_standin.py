"""The kubelet stand-in validates Register as the kubelet does, with the kubelet's texts."""

from __future__ import annotations

import grpc
import pytest

from common.kubeletapi import VERSION, pb
from common.kubeletapi.rpc import RegistrationClient, unix_target
from supervisor.sim.kubelet import KubeletStandin
from supervisor.sim.kubeletnode import is_extended_resource_name
from tests.helpers import short_tmpdir


def _register(
    kubelet: KubeletStandin, version: str, resource: str, endpoint: str = "x.sock"
) -> grpc.RpcError:
    channel = grpc.insecure_channel(unix_target(kubelet.socket_path))
    try:
        with pytest.raises(grpc.RpcError) as info:
            RegistrationClient(channel).Register(
                pb.RegisterRequest(version=version, endpoint=endpoint, resource_name=resource), timeout=10
            )
        return info.value
    finally:
        channel.close()


def test_bad_version_is_refused_with_kubelet_text() -> None:
    """A RegisterRequest with another API version fails with the kubelet's message and UNKNOWN."""
    with short_tmpdir() as d, KubeletStandin(d) as kubelet:
        err = _register(kubelet, "v1alpha", "nvidia.com/gpu")
        assert err.code() == grpc.StatusCode.UNKNOWN
        assert err.details() == (
            'requested API version "v1alpha" is not supported by kubelet. Supported version is ["v1beta1"]'
        )


@pytest.mark.parametrize(
    "name",
    ["gpu", "kubernetes.io/gpu", "requests.nvidia.com/gpu", "nvidia.com/-gpu", "nvidia.com/" + "g" * 64],
)
def test_bad_resource_name_is_refused_with_kubelet_text(name: str) -> None:
    """A resource name that is not an extended resource name fails with `the ResourceName ... is invalid`."""
    with short_tmpdir() as d, KubeletStandin(d) as kubelet:
        err = _register(kubelet, VERSION, name)
        assert err.details() == f'the ResourceName "{name}" is invalid'


def test_unreachable_endpoint_fails_register_with_options_error() -> None:
    """Register fails with `failed to get device plugin options` when the plugin cannot be dialled."""
    with short_tmpdir() as d, KubeletStandin(d, dial_timeout=0.5) as kubelet:
        err = _register(kubelet, VERSION, "nvidia.com/gpu", endpoint="nobody.sock")
        assert (err.details() or "").startswith("failed to get device plugin options: ")
        assert kubelet.registrations[-1].error.startswith("failed to get device plugin options")


@pytest.mark.parametrize(
    ("name", "ok"),
    [
        ("nvidia.com/gpu", True),
        ("nvidia.com/mig-1g.10gb", True),
        ("nvidia.com/mig-1g.10gb.me", True),
        ("example.com/a_b", True),
        ("nvidia.com/gpu.", False),
        ("/gpu", False),
    ],
)
def test_extended_resource_name_rules(name: str, ok: bool) -> None:
    """The extended-resource-name check accepts NVIDIA's names and rejects malformed ones."""
    assert is_extended_resource_name(name) is ok


def test_restart_deletes_sockets_but_keeps_other_files() -> None:
    """restart() removes every socket in the plugin dir, keeps regular files, and serves a fresh kubelet.sock."""
    import os
    import socket

    from tests.helpers import sockets_in

    with short_tmpdir() as d, KubeletStandin(d) as kubelet:
        stray = socket.socket(socket.AF_UNIX)
        stray.bind(os.path.join(d, "plugin.sock"))
        with open(os.path.join(d, "kubelet_internal_checkpoint"), "w") as fh:
            fh.write("{}")
        kubelet.restart()
        stray.close()
        assert sockets_in(d) == ["kubelet.sock"]
        assert os.path.exists(os.path.join(d, "kubelet_internal_checkpoint"))
        from common.procutil import unix_socket_listening

        assert unix_socket_listening(kubelet.socket_path)


@pytest.mark.parametrize("legacy_keying", [True, False])
def test_endpoint_closed_before_its_watch_starts_still_disconnects(legacy_keying: bool) -> None:
    """An endpoint closed before its ListAndWatch thread ran ends in _disconnect without raising:
    it is disconnected and, with legacy keying, the newer endpoint is disconnected too."""
    import os
    import time

    from common.kubeletapi.rpc import DevicePluginClient
    from supervisor.sim.kubelet import PluginEndpoint, Resource

    resource = "nvidia.com/gpu"
    with short_tmpdir() as d:
        kubelet = KubeletStandin(d, legacy_keying=legacy_keying)

        def endpoint(generation: int) -> PluginEndpoint:
            path = os.path.join(d, f"plugin-{generation}.sock")
            channel = grpc.insecure_channel(unix_target(path))
            return PluginEndpoint(
                resource=resource,
                socket_path=path,
                options=pb.DevicePluginOptions(),
                channel=channel,
                client=DevicePluginClient(channel),
                registered_at=time.monotonic(),
                generation=generation,
            )

        old, new = endpoint(1), endpoint(2)
        kubelet._resources[resource] = Resource(resource, endpoint=new)
        try:
            kubelet._close_endpoint(old)  # replaced by `new` before its watch thread got to run
            kubelet._watch(old)  # that thread's body, now
            assert not old.connected and old.stream is None
            assert new.connected is not legacy_keying
        finally:
            new.channel.close()
