"""The DRA worker's request figures, counted as NVIDIA's kubelet plugin counts its own.

NVIDIA's plugin (kubernetes-sigs/dra-driver-nvidia-gpu v0.4.1, pkg/metrics/dra_requests.go, called
from cmd/gpu-kubelet-plugin/driver.go `nodePrepareResource` / `nodeUnprepareResource` and
device_state.go `syncPreparedDevicesGaugeFromCheckpoint`) counts each claim of a prepare or
unprepare call (`operation` "prepare" / "unprepare"), times it in a histogram whose buckets are
`ExponentialBuckets(0.05, 2, 9)`, holds the claims in flight in a gauge, counts failures by the
step that failed (`error_type`), and gauges the devices of the prepared claims by type. gpuvisor
counts the same per claim, with a result ("ok" / "error") on the count and the histogram where
NVIDIA counts and times only what succeeded; the supervisor writes them out as `gpuvisor_dra_*`
(supervisor/observe/drafamilies.py; docs/dra.md, Metrics, has both sets of names).

A claim's time is that of the call that carried it: the kubelet sends a pod's claims of one driver
in one call (kubernetes pkg/kubelet/cm/dra/manager.go, `prepareResources`: one batch per driver),
and gpuvisor fetches them, then records them, together (NVIDIA's `PrepareResourceClaims` takes
them one by one, each under its prepare/unprepare lock). Error types: `prepare_devices` /
`unprepare_devices` (the claim's own error: its fetch, checks, sharing, CDI spec or checkpoint),
`invalid_request` (the request broke the wire contract: a claim without its UID) and `internal`
(a bug, logged with its traceback).

The figures travel in the worker's heartbeat as flat keys (worker/stats.py), cumulative ones
folded over worker lives by the supervisor: `dra_count:<operation>:<result>`,
`dra_sum:<operation>:<result>`, `dra_bucket:<operation>:<result>:<le>`,
`dra_errors:<operation>:<error type>`, and the gauges `gauge:dra_inflight:<operation>` and
`gauge:dra_prepared_devices:<node>:<device type>`.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Callable, Iterable, Mapping

from common.dracheckpoint import PreparedClaim
from common.model import AllocatableDevice
from worker.stats import cumulative

OPERATIONS = ("prepare", "unprepare")
RESULTS = ("ok", "error")
# NVIDIA's requestDurationSecondsBuckets, ExponentialBuckets(0.05, 2, 9): 0.05 s to 12.8 s. Doubling
# is exact in binary floating point, so these are the very values Go's loop makes.
BUCKETS: tuple[float, ...] = tuple(0.05 * 2**i for i in range(9))
# NVIDIA's device types (cmd/gpu-kubelet-plugin types.go, prepared.go), each always exported: a
# dashboard tells "0 MIG devices prepared" from "no data". gpuvisor prepares no vfio devices.
DEVICE_TYPES = ("gpu", "mig", "vfio", "unknown")
PREPARE_ERROR = "prepare_devices"
UNPREPARE_ERROR = "unprepare_devices"
INVALID_REQUEST = "invalid_request"
INTERNAL = "internal"


def device_type(name: str, devices: Mapping[str, AllocatableDevice]) -> str:
    """A prepared device's type: the plan's device says; one gone from the plan (a MIG change) is
    told by its DRA name (`gpu-0`, `gpu-0-mig-1g10gb-19-0`)."""
    device = devices.get(name)
    if device is not None:
        return "mig" if device.is_mig else "gpu"
    if "-mig-" in name:
        return "mig"
    return "gpu" if name.startswith("gpu-") else "unknown"


def prepared_devices(
    claims: Iterable[PreparedClaim], devices: Mapping[str, AllocatableDevice]
) -> dict[str, int]:
    """The devices of the prepared claims by type, every type present (0 when none)."""
    counts = dict.fromkeys(DEVICE_TYPES, 0)
    for claim in claims:
        for device in claim.devices:
            kind = device_type(device.device, devices)
            counts[kind] = counts.get(kind, 0) + 1
    return counts


class DraFigures:
    """Counts, times and in-flight claims of prepare and unprepare; thread-safe (the gRPC pool)."""

    def __init__(self, node: str, clock: Callable[[], float] = time.perf_counter) -> None:
        self.node = node
        self._clock = clock
        self._lock = threading.Lock()
        self._inflight = dict.fromkeys(OPERATIONS, 0)
        # Every series exists from the start, as NVIDIA's InitializeDRARequestMetrics makes them.
        keys = [(op, result) for op in OPERATIONS for result in RESULTS]
        self._buckets = {key: [0] * (len(BUCKETS) + 1) for key in keys}
        self._sums = dict.fromkeys(keys, 0.0)
        self._errors: dict[tuple[str, str], int] = {}
        self._prepared = dict.fromkeys(DEVICE_TYPES, 0)

    def begin(self, operation: str, claims: int) -> float:
        """A call with `claims` claims starts: they are in flight; its start time (perf_counter)."""
        with self._lock:
            self._inflight[operation] += claims
        return self._clock()

    def end(self, operation: str, started: float, claims: int, answers: int, errors: Iterable[str]) -> None:
        """The call that `begin` started with `claims` claims is answered: `answers` claims (one
        per UID), `errors` one error type per failed one; each is timed with the call's time."""
        seconds = max(0.0, self._clock() - started)
        failed = list(errors)
        with self._lock:
            self._inflight[operation] -= claims
            for result, n in (("ok", answers - len(failed)), ("error", len(failed))):
                if n <= 0:
                    continue
                self._buckets[(operation, result)][bisect.bisect_left(BUCKETS, seconds)] += n
                self._sums[(operation, result)] += seconds * n
            for kind in failed:
                self._errors[(operation, kind)] = self._errors.get((operation, kind), 0) + 1

    def set_prepared(self, counts: Mapping[str, int]) -> None:
        with self._lock:
            self._prepared = dict(counts)

    def snapshot(self) -> dict[str, float]:
        """The figures as heartbeat keys (see the module docstring)."""
        out: dict[str, float] = {}
        with self._lock:
            for (op, result), buckets in self._buckets.items():
                under, total = cumulative(BUCKETS, buckets)
                out.update((f"dra_bucket:{op}:{result}:{le!r}", n) for le, n in under)
                out[f"dra_count:{op}:{result}"] = total
                out[f"dra_sum:{op}:{result}"] = self._sums[(op, result)]
            for (op, kind), n in self._errors.items():
                out[f"dra_errors:{op}:{kind}"] = float(n)
            for op, n in self._inflight.items():
                out[f"gauge:dra_inflight:{op}"] = float(n)
            for kind, n in self._prepared.items():
                out[f"gauge:dra_prepared_devices:{self.node}:{kind}"] = float(n)
        return out
