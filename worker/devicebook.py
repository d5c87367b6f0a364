"""The device book: a device-plugin worker's health board as ListAndWatch lists it.

ListAndWatch sends the *full* device list each time (the kubelet takes each message as a
snapshot), each device Healthy or Unhealthy with its NUMA node. The list has no Unknown and no
room for a reason, so a device with no record yet is listed Healthy and a new reason alone is no
change. The message is built once per version, by the first stream that asks for it, not once
per stream.
"""

from __future__ import annotations

from collections.abc import Hashable

from common.kubeletapi import HEALTHY, UNHEALTHY, pb
from common.model import ResourcePlan
from worker.healthboard import Health, HealthBoard


def listed_healthy(health: Health | None) -> Hashable:
    """What the list shows of a record: healthy or not, and healthy until told otherwise."""
    return health is None or health.healthy


class DeviceBook(HealthBoard):
    """The resource's devices and their health; a version bump wakes every stream."""

    def __init__(self, plan: ResourcePlan) -> None:
        super().__init__(plan, shown=listed_healthy)
        self._message: tuple[int, pb.ListAndWatchResponse] | None = None

    def current(self) -> tuple[int, pb.ListAndWatchResponse]:
        """The version and its full device list, as one."""
        with self._cond:
            if self._message is None or self._message[0] != self._version:
                self._message = (self._version, self._build())
            return self._message

    def unhealthy_ids(self) -> frozenset[str]:
        """The devices listed Unhealthy, as the allocation policies take them."""
        return frozenset(self.unhealthy())

    def _build(self) -> pb.ListAndWatchResponse:
        devices = []
        for dev in self._plan.devices:
            health = HEALTHY if listed_healthy(self._health.get(dev.id)) else UNHEALTHY
            topology = None
            if dev.numa_node is not None and dev.numa_node >= 0:
                topology = pb.TopologyInfo(nodes=[pb.NUMANode(ID=dev.numa_node)])
            devices.append(pb.Device(ID=dev.id, health=health, topology=topology))
        return pb.ListAndWatchResponse(devices=devices)
