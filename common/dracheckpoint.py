"""The DRA worker's record of prepared claims, on disk: what an unprepare needs after a restart.

The DRA worker keeps it (`Checkpoint`); the supervisor only reads which devices it holds
(`held_devices`), to keep them out of the device plugin while the node runs as one.

`<kubelet plugins dir>/<driver>/checkpoint.json` (a host path, so it outlives the pod and the
worker) holds every prepared claim by UID with what the kubelet was answered: namespace, name
and, per device, the request, pool, device name and CDI device IDs, and how the claim's
configuration shares the device (`DeviceSharing`: TimeSlicing with its interval, MPS with its
limits, as worker.dra.config resolves them; `madeMig`, the MIG device made for it under
gpuvisor.dra.migOnDemand) with the claim's container edits, so an unprepare
after a restart undoes the sharing and destroys what was made (a file written before them reads as claims without
sharing). A prepare of a claim already
in it answers from it (no fetch: a kubelet that restarts re-prepares running pods' claims even
while the API server is away), an unprepare drops the claim, and a claim not in it unprepares as
a success (idempotent: the kubelet may ask twice, or ask another instance).

Written through the one atomic-write helper (`common.atomicfile`: temp file, fsync, rename, the
directory fsync'd) before the kubelet gets its answer, so the answer never runs ahead of the
record. Bounded: at most `MAX_CLAIMS` claims and `MAX_BYTES` bytes; a file that is unreadable or
not ours is moved aside (`checkpoint.json.bad-<time>`) with a log line rather than trusted or lost.

Version 2, `{"version": 2, "bootID": "<boot_id>" or null, "claims": {...}, "checksum": "<CRC-32,
8 hex digits>"}`, adds a checksum and the boot it was written in, as NVIDIA's DRA kubelet plugin
keeps them (kubernetes-sigs/dra-driver-nvidia-gpu at 9593204, in cmd/gpu-kubelet-plugin/ unless
said):
- checkpoint.go:26-35, checkpointv.go:74-81: the file holds a `v2` object of `checksum`,
  `preparedClaims` and `nodeBootID`, beside a `v1` view with its own checksum that
  checkpoint.go:53-63 writes too, for an older plugin to read. The `v2` checksum
  (checkpoint.go:81-89) is taken over the JSON of `v2` with the checksum set to 0, by the
  kubelet's pkg/kubelet/checkpointmanager/checksum/checksum.go:39-48: FNV-32a, widened to a
  uint64, fed not the JSON bytes but their rendering by pkg/util/hash/hash.go:29-32 (spew's
  `%#v` of the byte slice). checkpoint_manager.go:77-92 verifies it after each read; a mismatch
  is a CorruptCheckpointError (checksum.go:30-36), logged with a diff (device_state.go:739-741,
  756-778), and at start the plugin fails (device_state.go:255-258).
- pkg/bootid/bootid.go:10-22: the boot ID is /proc/sys/kernel/random/boot_id, trimmed; failing
  to read it at start fails the plugin (device_state.go:248-251).
- device_state.go:259-286: a checkpoint without a boot ID (older) is stamped with this boot's
  and its claims kept; one of this boot is kept; one of another boot is logged ("Invalidating
  checkpoint") and replaced by an empty one of this boot, since no container of an earlier boot
  runs and the devices and CDI specs it was prepared with may be gone. An unprepare of a claim
  not in the checkpoint is a success (device_state.go:499-506).
- checkpoint.go:37-51, checkpointv.go:108-120: an older version is upgraded when read (each v1
  claim counts as completely prepared) and written as the newest.

Here the same rules, with these differences, each for a reason:
- The checksum is zlib's CRC-32 over the canonical JSON of everything but the checksum (keys
  sorted, no spaces, ASCII): as wide as NVIDIA's, in C, and without hashlib, whose import loads
  OpenSSL (supervisor/config/fingerprint.py says why that matters). It finds a torn or edited
  file; it is no seal against an adversary, who can write a matching one, nor is NVIDIA's.
- A file that fails it is moved aside, as an unreadable one is, and the worker starts empty (its
  claims unprepare as successes) instead of refusing to start: a plugin that never starts frees
  nothing either, and the file is kept for whoever looks.
- A boot ID that cannot be read (not Linux, a sandbox without /proc) is unknown, not an error:
  no boot check is made then, as for a version-1 file. It is read through a function passed in
  (`current_boot_id` by default), for tests.
- A version-1 file (no checksum, boot unknown) is read as before, its claims kept, and `load`
  rewrites it as version 2 at once, as NVIDIA stamps it at start, so that a later reboot is seen.
  An unknown (newer) version is not trusted: moved aside, logged. No version-1 view is written
  beside version 2: a gpuvisor from before it moves the file aside (its claims then unprepare as
  successes) rather than reading it.
- Claims of another boot are dropped when read, by `read_claims` as by `load`, so the
  supervisor's `held_devices` agrees (a device held by a claim of an earlier boot is not held)
  without waiting for a DRA worker to rewrite the file: in mode device-plugin none may run.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import time
import zlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from common.atomicfile import write_atomic

log = logging.getLogger("gpuvisor.worker")

VERSION = 2
VERSIONS_READ = (1, 2)  # 1: before the checksum and the boot ID
CHECKPOINT_NAME = "checkpoint.json"
MAX_CLAIMS = 4096  # a node runs a few hundred pods at most; each claim a few devices
MAX_DEVICES_PER_CLAIM = 32  # AllocationResultsMaxSize
MAX_BYTES = 16 << 20
BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"
MAX_BOOT_ID = 64  # the kernel's is a UUID, 36 characters

BootIdSource = Callable[[], "str | None"]


def current_boot_id(path: str = BOOT_ID_PATH) -> str | None:
    """This boot's ID (the kernel makes a random UUID at each boot), or None where there is none
    to read (not Linux, a sandbox without /proc): unknown, which checks nothing."""
    try:
        with open(path, "rb") as fh:
            text = fh.read(MAX_BOOT_ID + 1).strip().decode("ascii")
    except (OSError, UnicodeDecodeError):
        return None
    return text if 0 < len(text) <= MAX_BOOT_ID else None


class CheckpointError(Exception):
    """The checkpoint cannot be written (or would be too big); the text says which and why."""


TIME_SLICING = "TimeSlicing"  # NVIDIA's sharing strategies (resource.nvidia.com/v1beta1, sharing.go)
MPS = "MPS"
# gpuvisor's own: a GPU shared by memory (consumable capacity), the share in `pinned_memory_limit`;
# the claim's containers are clients of the GPU's one MPS daemon (`memory_share_uid`).
MEMORY_SHARE = "MemoryShare"
STRATEGIES = (TIME_SLICING, MPS, MEMORY_SHARE)
MAX_PER_DEVICE_LIMITS = 64


@dataclass(frozen=True)
class DeviceSharing:
    """How a prepared device is shared, as its claim's configuration resolved
    (worker.dra.config): what an unprepare undoes, after a restart too."""

    strategy: str  # TIME_SLICING, MPS or MEMORY_SHARE
    uuid: str  # the device's own UUID (a GPU's or a MIG device's)
    gpu_uuid: str  # the GPU it is on: the one whose compute-policy timeslice was set
    interval: str = ""  # TimeSlicing: Default, Short, Medium or Long
    active_thread_percentage: int | None = None  # MPS, each None when unset
    pinned_memory_limit: int | None = (
        None  # MPS: bytes, every device of the claim's daemon; a memory share's bytes
    )
    per_device_pinned_memory_limit: tuple[tuple[str, int], ...] = ()  # MPS: (UUID, bytes)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"strategy": self.strategy, "uuid": self.uuid, "gpuUUID": self.gpu_uuid}
        if self.interval:
            out["interval"] = self.interval
        if self.active_thread_percentage is not None:
            out["activeThreadPercentage"] = self.active_thread_percentage
        if self.pinned_memory_limit is not None:
            out["pinnedMemoryLimit"] = self.pinned_memory_limit
        if self.per_device_pinned_memory_limit:
            out["perDevicePinnedMemoryLimit"] = dict(self.per_device_pinned_memory_limit)
        return out

    @classmethod
    def from_json(cls, raw: Any) -> DeviceSharing:
        if not isinstance(raw, dict) or raw.get("strategy") not in STRATEGIES:
            raise ValueError(f"a device's sharing is not an object of a known strategy: {raw!r:.80}")
        limits = raw.get("perDevicePinnedMemoryLimit", {})
        if not isinstance(limits, dict) or len(limits) > MAX_PER_DEVICE_LIMITS:
            raise ValueError("a device's per-device pinned memory limits are not a small object")
        return cls(
            strategy=raw["strategy"],
            uuid=_string(raw["uuid"]),
            gpu_uuid=_string(raw["gpuUUID"]),
            interval=_string(raw.get("interval", "")),
            active_thread_percentage=_optional_int(raw.get("activeThreadPercentage")),
            pinned_memory_limit=_optional_int(raw.get("pinnedMemoryLimit")),
            per_device_pinned_memory_limit=tuple((_string(k), _int(v)) for k, v in sorted(limits.items())),
        )


@dataclass(frozen=True)
class MadeMigRecord:
    """A MIG device made for its claim at prepare (gpuvisor.dra.migOnDemand): what its unprepare
    destroys, and what the supervisor keeps when it destroys instances no claim holds."""

    gpu_uuid: str
    gi_id: int
    ci_id: int
    uuid: str

    def to_json(self) -> dict[str, Any]:
        return {"gpuUUID": self.gpu_uuid, "gi": self.gi_id, "ci": self.ci_id, "uuid": self.uuid}

    @classmethod
    def from_json(cls, raw: Any) -> MadeMigRecord:
        if not isinstance(raw, dict):
            raise ValueError(f"a made MIG device is not an object: {raw!r:.80}")
        return cls(_string(raw["gpuUUID"]), _int(raw["gi"]), _int(raw["ci"]), _string(raw["uuid"]))


@dataclass(frozen=True)
class PreparedDevice:
    """One device of a prepared claim, as the kubelet was answered."""

    requests: tuple[str, ...]
    pool: str
    device: str
    cdi_device_ids: tuple[str, ...]
    share_id: str | None = None
    admin_access: bool = False  # beside whoever uses the device (monitoring): holds it for no one
    sharing: DeviceSharing | None = None  # None: the device is not shared by its claim's config
    made: MadeMigRecord | None = None  # the MIG device made for this claim (gpuvisor.dra.migOnDemand)

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
    # What the claim's sharing adds to its containers: CDI `containerEdits` JSON (an MPS claim's
    # pipe directory and limits), for the claim's CDI spec; {} for a claim without sharing.
    container_edits: Mapping[str, Any] = field(default_factory=dict)

    @property
    def shared(self) -> bool:
        """Does any device carry sharing, or a MIG device made for it, that an unprepare must undo?"""
        return any(d.sharing is not None or d.made is not None for d in self.devices)

    def to_json(self) -> dict[str, Any]:
        return {
            "namespace": self.namespace,
            "name": self.name,
            "preparedAt": self.prepared_at,
            **({"containerEdits": dict(self.container_edits)} if self.container_edits else {}),
            "devices": [
                {
                    "requests": list(d.requests),
                    "pool": d.pool,
                    "device": d.device,
                    "cdiDeviceIDs": list(d.cdi_device_ids),
                    **({"shareID": d.share_id} if d.share_id is not None else {}),
                    **({"adminAccess": True} if d.admin_access else {}),
                    **({"sharing": d.sharing.to_json()} if d.sharing is not None else {}),
                    **({"madeMig": d.made.to_json()} if d.made is not None else {}),
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
                    sharing=None if d.get("sharing") is None else DeviceSharing.from_json(d["sharing"]),
                    made=None if d.get("madeMig") is None else MadeMigRecord.from_json(d["madeMig"]),
                )
            )
        edits = raw.get("containerEdits", {})
        if not isinstance(edits, dict):
            raise ValueError(f"claim {uid}'s container edits are not an object")
        return cls(
            uid=uid,
            namespace=_string(raw["namespace"]),
            name=_string(raw["name"]),
            devices=tuple(devices),
            prepared_at=_finite(raw["preparedAt"]),
            container_edits=edits,
        )


def _string(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"expected a string, not {type(value).__name__}")
    return value


def _int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"expected an integer, not {value!r:.40}")
    return value


def _optional_int(value: Any) -> int | None:
    return None if value is None else _int(value)


def _finite(value: Any) -> float:
    # NaN and infinity parse (json.loads takes them) but cannot be written back (allow_nan=False).
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"expected a finite number, not {value!r}")
    return float(value)


def _strings(value: Any) -> list[str]:
    if not isinstance(value, list):
        raise ValueError(f"expected a list, not {type(value).__name__}")
    return [_string(v) for v in value]


class UntrustedCheckpoint(CheckpointError):
    """The file is there but is not a checkpoint gpuvisor wrote (or is over the limits)."""


def _checksum(body: Mapping[str, Any]) -> str:
    """The CRC-32 of `body`'s canonical JSON (keys sorted, no spaces, ASCII), in 8 hex digits: the
    same for the same data however the file was laid out. Raises ValueError for NaN or infinity."""
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return f"{zlib.crc32(text.encode('ascii')):08x}"


@dataclass(frozen=True)
class Stored:
    """What a checkpoint file holds, checked (see `read_checkpoint`)."""

    version: int  # 0: there is no file
    boot_id: str | None  # the boot it was written in; None: unknown (version 1, or unreadable then)
    claims: Mapping[str, PreparedClaim]  # by UID; none when written in another boot
    stale: int = 0  # the claims of another boot, left out of `claims`


NO_FILE = Stored(version=0, boot_id=None, claims={})


def read_checkpoint(path: str, boot_id: str | None) -> Stored:
    """The checkpoint file at `path`, read in the boot `boot_id` (None: unknown, no boot check);
    nothing is changed on disk. Claims written in another boot are left out (`Stored.stale`
    counts them). Raises CheckpointError (unreadable) or UntrustedCheckpoint (not ours, over the
    limits, a version this code does not know, or a checksum that does not match)."""
    try:
        with open(path, "rb") as fh:
            data = fh.read(MAX_BYTES + 1)
    except FileNotFoundError:
        return NO_FILE
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        if len(data) > MAX_BYTES:
            raise ValueError(f"over {MAX_BYTES} bytes")
        raw = json.loads(data)
        version = raw.get("version") if isinstance(raw, dict) else None
        if type(version) is not int or version not in VERSIONS_READ:  # True == 1: not a version
            raise ValueError(f"not a gpuvisor checkpoint of version {' or '.join(map(str, VERSIONS_READ))}")
        written_in = None
        if version >= 2:
            body = {k: v for k, v in raw.items() if k != "checksum"}
            if raw.get("checksum") != (expected := _checksum(body)):
                raise ValueError(
                    f"checksum mismatch (the file says {raw.get('checksum')!r}, its contents sum to "
                    f"{expected!r}): torn or edited"
                )
            written_in = raw["bootID"]
            if written_in is not None:
                written_in = _string(written_in)
        if not isinstance(raw["claims"], dict):
            raise ValueError("its claims are not an object")
        if len(raw["claims"]) > MAX_CLAIMS:
            raise ValueError(f"{len(raw['claims'])} claims, at most {MAX_CLAIMS}")
        claims = {uid: PreparedClaim.from_json(uid, c) for uid, c in raw["claims"].items()}
    except (ValueError, KeyError, TypeError, RecursionError) as exc:
        raise UntrustedCheckpoint(str(exc)) from None
    if written_in is not None and boot_id is not None and written_in != boot_id:
        # A reboot ended every container the claims were prepared for (NVIDIA's rule).
        return Stored(version=version, boot_id=written_in, claims={}, stale=len(claims))
    return Stored(version=version, boot_id=written_in, claims=claims)


def read_claims(path: str, boot_id: BootIdSource = current_boot_id) -> dict[str, PreparedClaim]:
    """The claims in the checkpoint file at `path` that this boot's containers may hold, by UID
    ({} when there is none; none of another boot); nothing is changed on disk. Raises
    CheckpointError (unreadable) or UntrustedCheckpoint (not ours)."""
    return dict(read_checkpoint(path, boot_id()).claims)


def memory_share_uid(gpu_uuid: str) -> str:
    """The owner name of the MPS daemon that serves a GPU's memory shares: every claim sharing
    the GPU by memory is its client, and it stays while any of them is prepared."""
    return "memshare-" + "".join(c if c.isalnum() or c in "._-" else "_" for c in gpu_uuid)[:80]


def daemon_owners(path: str, boot_id: BootIdSource = current_boot_id) -> frozenset[str]:
    """Who may keep an MPS daemon of claims: the prepared claims' UIDs, and the memory-share
    owner of each GPU a prepared claim shares by memory. Raises CheckpointError."""
    claims = read_claims(path, boot_id)
    shares = {
        memory_share_uid(d.sharing.gpu_uuid)
        for c in claims.values()
        for d in c.devices
        if d.sharing is not None and d.sharing.strategy == MEMORY_SHARE
    }
    return frozenset(claims) | shares


def held_devices(directory: str, boot_id: BootIdSource = current_boot_id) -> frozenset[str]:
    """The devices that prepared claims in `<directory>/checkpoint.json` hold (admin access and
    shares included: the device is in a container either way), none for claims of an earlier
    boot. Raises CheckpointError."""
    claims = read_claims(os.path.join(directory, CHECKPOINT_NAME), boot_id)
    return frozenset(d.device for c in claims.values() for d in c.devices)


class Checkpoint:
    """The prepared claims, in memory and on disk. Not thread-safe: the caller serializes."""

    def __init__(self, directory: str, boot_id: BootIdSource = current_boot_id) -> None:
        self.path = os.path.join(directory, CHECKPOINT_NAME)
        self.boot_id = boot_id()  # once: a boot lasts longer than a process; stamped on each write
        self._claims: dict[str, PreparedClaim] = {}

    def __len__(self) -> int:
        return len(self._claims)

    def get(self, uid: str) -> PreparedClaim | None:
        return self._claims.get(uid)

    def load(self) -> None:
        """Read the file (a missing one is an empty checkpoint). One that cannot be trusted is
        moved aside and logged; the claims it held unprepare as successes, and prepare again by
        fetching them. Claims of an earlier boot are dropped (an unprepare of one is then a
        success), and a file of another version or boot is rewritten at once as this one's: a
        failing rewrite is logged and left to the next write."""
        try:
            stored = read_checkpoint(self.path, self.boot_id)
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
            return
        self._claims = dict(stored.claims)
        if stored.stale:
            log.info(
                "the DRA checkpoint %s is of boot %s, this is boot %s: its %d prepared claim(s) ended "
                "with that boot, dropped (an unprepare of one is a success)",
                self.path,
                stored.boot_id,
                self.boot_id,
                stored.stale,
            )
        elif stored.version and stored.version != VERSION:
            log.info(
                "the DRA checkpoint %s is of version %d (no checksum, boot unknown): its %d prepared "
                "claim(s) kept, rewritten as version %d",
                self.path,
                stored.version,
                len(self._claims),
                VERSION,
            )
        # Not when this boot is unknown and the file knows its own: a write now would forget it.
        stamp = self.boot_id is not None and stored.boot_id != self.boot_id
        if stored.version and (stored.version != VERSION or stamp):
            try:
                self._write(self._claims)
            except CheckpointError as exc:
                log.warning("cannot rewrite the DRA checkpoint (%s): left as it is until the next write", exc)

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

    def claims(self) -> list[PreparedClaim]:
        return list(self._claims.values())

    def holders(self, device: str) -> list[PreparedClaim]:
        """The prepared claims that hold `device` for themselves (see `PreparedDevice.exclusive`)."""
        return [
            c for c in self._claims.values() if any(d.device == device and d.exclusive for d in c.devices)
        ]

    def _write(self, claims: Mapping[str, PreparedClaim]) -> None:
        if len(claims) > MAX_CLAIMS:
            raise CheckpointError(f"{len(claims)} prepared claims would be over the limit of {MAX_CLAIMS}")
        body: dict[str, Any] = {
            "version": VERSION,
            "bootID": self.boot_id,
            "claims": {uid: c.to_json() for uid, c in sorted(claims.items())},
        }
        text = json.dumps({**body, "checksum": _checksum(body)}, separators=(",", ":"), allow_nan=False)
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
