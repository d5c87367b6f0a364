"""How big a resource's ListAndWatch answer is, computed from counts before any list exists.

The kubelet reads ListAndWatch with gRPC's default 4 MiB receive limit; a plugin whose answer is
larger is never heard (its Register keeps failing at the kubelet's end of the stream). A plan is
therefore refused before its devices are built when its worst-case answer (every device
"Unhealthy", the longer health string) would not fit with a margin to spare. The size is the
exact protobuf encoding of `v1beta1.ListAndWatchResponse` as the worker builds it (ID, health,
and a NUMA node when known), summed per replica-number length, so a plan of a billion replicas
costs a few dozen arithmetic steps, not a billion devices. tests/unit/test_plansize.py checks the
arithmetic against the real encoder.
"""

from __future__ import annotations

from typing import Final

# The kubelet's gRPC client: google.golang.org/grpc defaultClientMaxReceiveMessageSize = 4 MiB.
KUBELET_MAX_RECEIVE_BYTES: Final = 4 * 1024 * 1024
# What gpuvisor allows a plan: 1/8 below the limit, room for the framing of a newer API
# version's extra fields and for the kubelet's own limit being set lower than the default.
LIST_AND_WATCH_BUDGET: Final = KUBELET_MAX_RECEIVE_BYTES - KUBELET_MAX_RECEIVE_BYTES // 8
_WORST_HEALTH: Final = len("Unhealthy")


def varint_size(value: int) -> int:
    """Bytes of a protobuf varint (value >= 0)."""
    size = 1
    while value >= 0x80:
        value >>= 7
        size += 1
    return size


def _field(payload: int) -> int:
    """A length-delimited field with a one-byte tag: tag, length, payload."""
    return 1 + varint_size(payload) + payload


def device_entry_size(id_bytes: int, numa_node: int | None) -> int:
    """Bytes one `Device` adds to a ListAndWatchResponse (the repeated field's tag and length included)."""
    size = _field(id_bytes) + _field(_WORST_HEALTH)
    if numa_node is not None and numa_node >= 0:
        numa = 0 if numa_node == 0 else 1 + varint_size(numa_node)  # proto3 leaves ID=0 out
        size += _field(_field(numa))  # topology: TopologyInfo{nodes: [NUMANode{ID}]}
    return _field(size)


def replicas_size(id_bytes: int, replicas: int, numa_node: int | None) -> int:
    """Bytes of the `replicas` devices `<id>::0` ... `<id>::<replicas-1>`, grouped by the length of n."""
    total = 0
    low, digits = 0, 1
    while low < replicas:
        high = min(replicas, 10**digits)  # n in [low, high) has `digits` digits
        total += (high - low) * device_entry_size(id_bytes + 2 + digits, numa_node)
        low, digits = high, digits + 1
    return total
