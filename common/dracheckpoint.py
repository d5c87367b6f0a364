"""The DRA worker's record of prepared claims, on disk: what an unprepare needs after a restart.

The DRA worker keeps it (`Checkpoint`); the supervisor only reads which devices it holds
(`held_devices`), to keep them out of the device plugin while the node runs as one.

`<kubelet plugins dir>/<driver>/checkpoint.json` (a host path, so it outlives the pod and the
worker) holds every prepared claim by UID with what the kubelet was answered: namespace, name
and, per device, the request, pool, device name and CDI device IDs. A prepare of a claim already
in it answers from it (no fetch: a kubelet that restarts re-prepares running pods' claims even
while the API server is away), an unprepare drops the claim, and a claim not in it unprepares as
a success (idempotent: the kubelet may ask twice, or ask another instance).

Written through the one atomic-write helper (`common.atomicfile`: temp file, fsync, rename, the
directory fsync'd) before the kubelet gets its answer, so the answer never runs ahead of the
record. Bounded: at most `MAX_CLAIMS` claims and `MAX_BYTES` bytes; a file that is unreadable or
not ours is moved aside (`checkpoint.json.bad-<time>`) with a log line rather than trusted or lost.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from common.atomicfile import write_atomic

log = logging.getLogger("gpuvisor.worker")

VERSION = 1
CHECKPOINT_NAME = "checkpoint.json"
MAX_CLAIMS = 4096  # a node runs a few hundred pods at most; each claim a few devices
MAX_DEVICES_PER_CLAIM = 32  # AllocationResultsMaxSize
MAX_BYTES = 16 << 20


class CheckpointError(Exception):
    """The checkpoint cannot be written (or would be too big); the text says which and why."""


@dataclass(frozen=True)
class PreparedDevice:
    """One device of a prepared claim, as the kubelet was answered."""

    requests: tuple[str, ...]
    pool: str
    device: str
    cdi_device_ids: tuple[str, ...]
    share_id: str | None = None
    admin_access: bool = False  # beside whoever uses the device (monitoring): holds it for no one

    @property
    def exclusive(self) -> bool:
        """Does this claim hold the device for itself (no admin access, no share)?"""
        return not (self.admin_access or self.share_id)


@dataclass(frozen=True)
class PreparedClaim:
    uid: str
    namespace: str
    name: str
    devices: tuple[PreparedDevice, ...]
    prepared_at: float  # wall clock

    def to_json(self) -> dict[str, Any]:
        return {
            "namespace": self.namespace,
            "name": self.name,
            "preparedAt": self.prepared_at,
            "devices": [
                {
                    "requests": list(d.requests),
                    "pool": d.pool,
                    "device": d.device,
                    "cdiDeviceIDs": list(d.cdi_device_ids),
                    **({"shareID": d.share_id} if d.share_id is not None else {}),
                    **({"adminAccess": True} if d.admin_access else {}),
                }
                for d in self.devices
            ],
        }

    @classmethod
    def from_json(cls, uid: str, raw: Any) -> PreparedClaim:
        """Raises ValueError (or KeyError, TypeError) for anything that is not a claim we wrote."""
        if not isinstance(raw, dict) or not isinstance(raw["devices"], list):
            raise ValueError(f"claim {uid} is not an object with a device list")
        if len(raw["devices"]) > MAX_DEVICES_PER_CLAIM:
            raise ValueError(f"claim {uid} has {len(raw['devices'])} devices")
        devices = []
        for d in raw["devices"]:
            share = d.get("shareID")
            devices.append(
                PreparedDevice(
                    requests=tuple(_strings(d["requests"])),
                    pool=_string(d["pool"]),
                    device=_string(d["device"]),
                    cdi_device_ids=tuple(_strings(d["cdiDeviceIDs"])),
                    share_id=None if share is None else _string(share),
                    admin_access=d.get("adminAccess") is True,
                )
            )
        return cls(
            uid=uid,
            namespace=_string(raw["namespace"]),
            name=_string(raw["name"]),
            devices=tuple(devices),
            prepared_at=float(raw["preparedAt"]),
        )


def _string(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"expected a string, not {type(value).__name__}")
    return value


def _strings(value: Any) -> list[str]:
    if not isinstance(value, list):
        raise ValueError(f"expected a list, not {type(value).__name__}")
    return [_string(v) for v in value]


class UntrustedCheckpoint(CheckpointError):
    """The file is there but is not a checkpoint gpuvisor wrote (or is over the limits)."""


def read_claims(path: str) -> dict[str, PreparedClaim]:
    """The claims in the checkpoint file at `path`, by UID ({} when there is none); nothing is
    changed on disk. Raises CheckpointError (unreadable) or UntrustedCheckpoint (not ours)."""
    try:
        with open(path, "rb") as fh:
            data = fh.read(MAX_BYTES + 1)
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        if len(data) > MAX_BYTES:
            raise ValueError(f"over {MAX_BYTES} bytes")
        raw = json.loads(data)
        if not isinstance(raw, dict) or raw.get("version") != VERSION or not isinstance(raw["claims"], dict):
            raise ValueError(f"not a version-{VERSION} gpuvisor checkpoint")
        if len(raw["claims"]) > MAX_CLAIMS:
            raise ValueError(f"{len(raw['claims'])} claims, at most {MAX_CLAIMS}")
        return {uid: PreparedClaim.from_json(uid, c) for uid, c in raw["claims"].items()}
    except (ValueError, KeyError, TypeError, RecursionError) as exc:
        raise UntrustedCheckpoint(str(exc)) from None


def held_devices(directory: str) -> frozenset[str]:
    """The devices that prepared claims in `<directory>/checkpoint.json` hold (admin access and
    shares included: the device is in a container either way). Raises CheckpointError."""
    claims = read_claims(os.path.join(directory, CHECKPOINT_NAME))
    return frozenset(d.device for c in claims.values() for d in c.devices)


class Checkpoint:
    """The prepared claims, in memory and on disk. Not thread-safe: the caller serializes."""

    def __init__(self, directory: str) -> None:
        self.path = os.path.join(directory, CHECKPOINT_NAME)
        self._claims: dict[str, PreparedClaim] = {}

    def __len__(self) -> int:
        return len(self._claims)

    def get(self, uid: str) -> PreparedClaim | None:
        return self._claims.get(uid)

    def load(self) -> None:
        """Read the file (a missing one is an empty checkpoint). One that cannot be trusted is
        moved aside and logged; the claims it held unprepare as successes, and prepare again by
        fetching them."""
        try:
            self._claims = read_claims(self.path)
        except UntrustedCheckpoint as exc:
            aside = f"{self.path}.bad-{int(time.time())}"
            with contextlib.suppress(OSError):
                os.replace(self.path, aside)
            log.error(
                "the DRA checkpoint %s cannot be used (%s): moved to %s, starting empty",
                self.path,
                exc,
                aside,
            )
            self._claims = {}

    def put(self, claims: Iterable[PreparedClaim]) -> None:
        """Record these claims, then write; on failure nothing changes (raises CheckpointError)."""
        new = dict(self._claims)
        for claim in claims:
            new[claim.uid] = claim
        self._write(new)

    def drop(self, uids: Iterable[str]) -> None:
        """Forget these claims, then write; on failure nothing changes (raises CheckpointError)."""
        gone = set(uids)  # once: a generator would be used up by the first claim's test
        new = {uid: c for uid, c in self._claims.items() if uid not in gone}
        if len(new) != len(self._claims):
            self._write(new)

    def holders(self, device: str) -> list[PreparedClaim]:
        """The prepared claims that hold `device` for themselves (see `PreparedDevice.exclusive`)."""
        return [
            c for c in self._claims.values() if any(d.device == device and d.exclusive for d in c.devices)
        ]

    def _write(self, claims: Mapping[str, PreparedClaim]) -> None:
        if len(claims) > MAX_CLAIMS:
            raise CheckpointError(f"{len(claims)} prepared claims would be over the limit of {MAX_CLAIMS}")
        text = json.dumps(
            {"version": VERSION, "claims": {uid: c.to_json() for uid, c in sorted(claims.items())}},
            separators=(",", ":"),
        )
        if len(text) > MAX_BYTES:
            raise CheckpointError(f"the checkpoint would be {len(text)} bytes, over the limit of {MAX_BYTES}")
        try:
            os.makedirs(os.path.dirname(self.path), mode=0o750, exist_ok=True)
            write_atomic(self.path, text, 0o600, sync_dir=True)
        except OSError as exc:
            raise CheckpointError(
                f"cannot write {exc.filename or self.path}: {exc.strerror or exc}"
            ) from None
        self._claims = dict(claims)
