"""Each prepared claim's device health in the ResourceClaim's own status: `ClaimStatusWriter`.

Why: kubelet 1.34 fills a pod's `allocatedResourcesStatus` from the driver's health stream only
for a claim the pod references by its own name: for a claim made from a ResourceClaimTemplate, or
by the scheduler for an extended resource, it stays empty (it matched the pod's claim name to the
ResourceClaim's; kubernetes#134875 fixed templates in 1.35, extended-resource claims still stay
empty). The claim's own `status.devices` (KEP-4817, `DRAResourceClaimDeviceStatus`, beta and on
since 1.33) is written by the driver and read by anyone: `kubectl get resourceclaim -o yaml`.

What is written, for every claim the DRA worker's checkpoint holds: one `status.devices` entry
per device of this driver the claim was answered with (driver, pool, device, the share ID when
there is one), with one condition, type `Healthy`: `True` (reason `DeviceHealthy`) or `False`
with the health book's reason (`XidCriticalError`, `GpuLost`, ... as on the Node) and its words,
`lastTransitionTime` when the health last changed, `observedGeneration` the claim's. Entries of
other drivers are kept as they are. A change of health rewrites the entries of the claims it
touches; an unprepare removes this driver's entries (the API server drops them by itself when the
claim is deallocated: resourceclaim strategy's `dropDeallocatedStatusDevices`).

How: one thread, on the node's API client (its limiter), never the main loop: GET the claim (its
UID must be the prepared one), compute the new `status.devices`, and only when it differs PUT the
`status` subresource with the claim's resourceVersion (a conflict is read again and retried at
once, a few times). The kubelet path never waits on it: a prepare's answer goes before its status
is written, and an API server that refuses it (RBAC, the gate off, an old server) costs a log line
per distinct error and a counted failure (`gpuvisor_dra_api_total{what="claim-status"}`), retried
with capped backoff, never a failed prepare.
"""

from __future__ import annotations

import copy
import datetime
import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from common.backoff import Backoff
from common.dracheckpoint import PreparedClaim
from common.messages import Json
from supervisor.cluster.health import reason_of
from supervisor.dra.background import PassThread
from supervisor.dra.memshare import status_data
from supervisor.kube.client import KubeClient
from supervisor.kube.errors import ApiError, Stopped
from supervisor.kube.watch import quote

log = logging.getLogger("gpuvisor.dra")

CONDITION = "Healthy"
HEALTHY_REASON = "DeviceHealthy"
MAX_MESSAGE = 1024
QUICK_RETRIES = 3


@dataclass(frozen=True)
class DeviceHealthView:
    """A device's health as the claim's status shows it."""

    healthy: bool
    reason: str = ""  # the health book's words
    since: float = 0.0  # wall time of the last change (0: unknown)
    condition: str = ""  # the gravest health condition's name ("xid:48", "lost", ...)


def _time(since: float) -> str:
    moment = (
        datetime.datetime.fromtimestamp(since, datetime.UTC)
        if since > 0
        else datetime.datetime.now(datetime.UTC)
    )
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def condition_of(health: DeviceHealthView | None, generation: int) -> dict[str, Any]:
    """The `Healthy` condition of one device (a device the health book does not know is Unknown)."""
    if health is None:
        status, reason, message, since = (
            "Unknown",
            "HealthUnknown",
            "gpuvisor has no health for this device",
            0.0,
        )
    elif health.healthy:
        status, reason, message, since = "True", HEALTHY_REASON, "healthy", health.since
    else:
        words = health.reason or "unhealthy"
        status, reason, message, since = "False", reason_of(health.condition), words, health.since
    if len(message) > MAX_MESSAGE:
        message = message[: MAX_MESSAGE - 3] + "..."
    return {
        "type": CONDITION,
        "status": status,
        "reason": reason,
        "message": message,
        "lastTransitionTime": _time(since),
        "observedGeneration": generation,
    }


class ClaimStatusWriter(PassThread):
    NAME = "dra-claim-status"
    WHAT = "claim-status"
    FAILED = (
        "cannot write the health of prepared claims into their ResourceClaim status "
        "(retrying with backoff; prepares are unaffected): %s"
    )
    AGAIN = "claims' device health is written again (after %.0f s)"

    def __init__(
        self,
        client: KubeClient,
        *,
        driver: str,
        on_count: Callable[[str, str], None] = lambda what, result: None,
        retry: Backoff | None = None,
    ) -> None:
        super().__init__(client, on_count=on_count, retry=retry)
        self.driver = driver
        self._claims: dict[str, PreparedClaim] = {}
        self._health: dict[str, DeviceHealthView] = {}
        # uid -> (namespace, name, the form of the entries written): what this thread wrote
        self._written: dict[str, tuple[str, str, str]] = {}
        self.writes = 0
        self.cleared = 0
        self.refused: dict[str, str] = {}  # claim UID -> why the server refused its status (422)

    # ------------------------------------------------------------------ from the main loop
    def want(self, claims: Mapping[str, PreparedClaim], health: Mapping[str, DeviceHealthView]) -> None:
        with self._lock:
            self._claims = dict(claims)
            self._health = dict(health)
        self._wake.set()

    # ------------------------------------------------------------------ the thread
    def step(self) -> float | None:
        with self._lock:
            claims, health = dict(self._claims), dict(self._health)
        self._pass(claims, health)
        return None

    def _pass(self, claims: Mapping[str, PreparedClaim], health: Mapping[str, DeviceHealthView]) -> None:
        """Each claim whose entries should differ from what this thread last wrote (a new claim,
        a change of its devices' health) is read and written; the others cost nothing."""
        for uid, claim in sorted(claims.items()):
            if self.client.stopped:
                raise Stopped("stopped")
            written = self._written.get(uid)
            if written is not None and written[2] == _form(self._entries(claim, health, 0)):
                continue
            self._write(uid, claim.namespace, claim.name, claim, health)
        for uid in set(self.refused) - set(claims):
            del self.refused[uid]
        for uid in sorted(set(self._written) - set(claims)):
            namespace, name, _form_written = self._written[uid]
            self._write(uid, namespace, name, None, health)

    def _entries(
        self, claim: PreparedClaim, health: Mapping[str, DeviceHealthView], generation: int
    ) -> list[Any]:
        out = []
        for device in claim.devices:
            entry: dict[str, Any] = {"driver": self.driver, "pool": device.pool, "device": device.device}
            if device.share_id:
                entry["shareID"] = device.share_id
            entry["conditions"] = [condition_of(health.get(device.device), generation)]
            share = status_data(device.sharing)  # a GPU shared by memory: the claim's share
            if share is not None:
                entry["data"] = share
            out.append(entry)
        return out

    def _write(
        self,
        uid: str,
        namespace: str,
        name: str,
        claim: PreparedClaim | None,
        health: Mapping[str, DeviceHealthView],
    ) -> None:
        """Bring one claim's entries of this driver to what they should be (none: `claim` None)."""
        path = f"/apis/resource.k8s.io/v1/namespaces/{quote(namespace)}/resourceclaims/{quote(name)}"
        for attempt in range(QUICK_RETRIES + 1):
            try:
                current = self.client.get(path, what=f"get ResourceClaim {namespace}/{name}")
            except ApiError as exc:
                if exc.not_found:
                    self._written.pop(uid, None)
                    return
                raise
            meta = current.get("metadata") if isinstance(current, dict) else None
            if not isinstance(meta, dict) or meta.get("uid") != uid:
                self._written.pop(uid, None)  # another claim by that name now: not ours to write
                return
            status = current.get("status") if isinstance(current.get("status"), dict) else {}
            before = [d for d in status.get("devices") or [] if isinstance(d, dict)]
            others = [d for d in before if d.get("driver") != self.driver]
            raw_generation = meta.get("generation")
            generation = raw_generation if isinstance(raw_generation, int) else 0
            ours = self._entries(claim, health, generation) if claim is not None else []
            after = others + ours
            if _form(before) == _form(after):
                self._note(uid, namespace, name, claim, ours)
                return
            body = copy.deepcopy(current)
            body.setdefault("status", {})["devices"] = after
            if not after:
                body["status"].pop("devices", None)
            try:
                self.client.request(
                    "PUT", f"{path}/status", what=f"update ResourceClaim {namespace}/{name} status", body=body
                )
            except ApiError as exc:
                if exc.conflict and attempt < QUICK_RETRIES:
                    self.on_count(self.WHAT, exc.kind)  # tried again at once; a failure is counted once
                    continue
                if exc.not_found:
                    self._written.pop(uid, None)
                    return
                if exc.status == 422:  # this claim's own trouble (deallocated meanwhile...): the others go on
                    self.on_count(self.WHAT, exc.kind)
                    if self.refused.get(uid) != exc.describe():
                        log.warning(
                            "ResourceClaim %s/%s refused its status: %s", namespace, name, exc.describe()
                        )
                    self.refused[uid] = exc.describe()
                    return
                raise
            self.refused.pop(uid, None)
            self.on_count(self.WHAT, "ok")
            if claim is None:
                self.cleared += 1
                log.info(
                    "cleared the device health of unprepared claim %s/%s from its status", namespace, name
                )
            else:
                self.writes += 1
                log.info(
                    "ResourceClaim %s/%s status: %s",
                    namespace,
                    name,
                    ", ".join(f"{e['device']} {e['conditions'][0]['status']}" for e in ours),
                )
            self._note(uid, namespace, name, claim, ours)
            return

    def _note(
        self, uid: str, namespace: str, name: str, claim: PreparedClaim | None, ours: list[Any]
    ) -> None:
        if claim is None:
            self._written.pop(uid, None)
        else:
            self._written[uid] = (namespace, name, _form(ours))

    def status(self) -> dict[str, Json]:
        return {
            "claims": len(self._written),
            "refused": len(self.refused),
            "writes": self.writes,
            "cleared": self.cleared,
            **self.failing.status(),
        }


def _form(entries: list[Any]) -> str:
    """What a list of entries says, in the order of their keys and without the times and
    generations that a rewrite would move: equal forms need no write."""
    out = []
    for entry in entries:
        entry = copy.deepcopy(entry)
        for cond in entry.get("conditions") or []:
            if isinstance(cond, dict):
                cond.pop("lastTransitionTime", None)
                cond.pop("observedGeneration", None)
        out.append(entry)
    out.sort(key=lambda e: tuple(str(e.get(k)) for k in ("driver", "pool", "device", "shareID")))
    return json.dumps(out, sort_keys=True)
