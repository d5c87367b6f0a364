"""The ZeroMQ wire format between the supervisor, its workers and the CLI: the only module that
knows how a message looks on the wire.

Every message is two frames, `[topic, body]`:

- `topic` is `b"health"` for what the supervisor PUBlishes to every worker (one topic for all
  resources, see below) and `b"control"` for everything on the ROUTER/DEALER control socket
  (worker <-> supervisor, CLI <-> supervisor). A ROUTER sees routing frames in front of these
  two; `split_routed` separates them.
- `body` is compact UTF-8 JSON, the envelope
  `{"v": PROTOCOL_VERSION, "seq": n, "time": wall, "kind": "...", "payload": {...}}`.
  `seq` counts the messages one sender sent (a `SequenceCounter` per socket); it is for logs and
  duplicate spotting. Health ordering uses the health sequence number inside the payload.

`decode` is strict: wrong frame count, non-UTF-8, bad JSON, another protocol version, an unknown
kind, a kind sent on the wrong topic, a missing, extra or wrongly typed field all raise
`MessageError` with the reason, and nothing else escapes it, so a receive loop can log and drop.

Health uses the "clone" pattern: a worker subscribes, asks for a `HealthSnapshot` of its
resource at sequence S over control, then applies only deltas with seq > S (the worker's
`worker.healthcopy.HealthApplier`). A `PlanUpdate` carries the snapshot of its new devices, so a
reload needs no second round trip.
One topic with one node-wide sequence, rather than a topic per resource, is a deliberate choice:
every worker sees every sequence number, so a missing delta is always seen as a gap. Deltas carry
device IDs only; a worker ignores IDs that are not in its plan. `HealthBeacon`s, published
periodically with the current sequence, reveal a lost last delta that no later delta would show.
`epoch` names one supervisor life, so a worker never mixes two supervisors' sequences.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, get_args

from common.messagefields import CONTROL_TOPIC as CONTROL_TOPIC

# The readers live apart (common/messagefields.py); Json and MessageError are this module's to
# every importer, as before.
from common.messagefields import Json as Json
from common.messagefields import MessageError as MessageError
from common.messagefields import (
    _bool,
    _dict,
    _Flat,
    _float,
    _int,
    _list,
    _number_dict,
    _object,
    _only,
    _require,
    _str,
)
from common.migmessages import MigClaimReply, MigClaimRequest
from common.mpsmessages import MpsClaimReply, MpsClaimRequest

PROTOCOL_VERSION = 1

# The largest message a control or health socket accepts (ZMQ_MAXMSGSIZE): a status document of
# a big node is a few hundred KiB; a peer that sends more is disconnected by ZeroMQ itself.
MAX_MESSAGE_BYTES = 4 * 1024 * 1024

HEALTH_TOPIC = b"health"
_TOPICS = (HEALTH_TOPIC, CONTROL_TOPIC)

# Envelope keys, once.
_K_VERSION = "v"
_K_SEQ = "seq"
_K_TIME = "time"
_K_KIND = "kind"
_K_PAYLOAD = "payload"
_ENVELOPE_KEYS = frozenset({_K_VERSION, _K_SEQ, _K_TIME, _K_KIND, _K_PAYLOAD})


# ---------------------------------------------------------------------------------------------
# Records carried inside messages.


@dataclass(frozen=True)
class DeviceHealth:
    """The health of one allocatable device ID, as of `since` (wall time of the last flip)."""

    device_id: str
    healthy: bool
    reason: str
    since: float

    _FIELDS: ClassVar[tuple[str, ...]] = ("device_id", "healthy", "reason", "since")

    def to_payload(self) -> dict[str, Json]:
        return {
            "device_id": self.device_id,
            "healthy": self.healthy,
            "reason": self.reason,
            "since": self.since,
        }

    @classmethod
    def from_payload(cls, raw: Json, path: str) -> DeviceHealth:
        obj = _object(raw, f"field {path!r}")
        _only(obj, cls._FIELDS, path)
        return cls(
            device_id=_str(obj, "device_id", path),
            healthy=_bool(obj, "healthy", path),
            reason=_str(obj, "reason", path),
            since=_float(obj, "since", path),
        )


def _health_list(obj: Mapping[str, Json], name: str) -> tuple[DeviceHealth, ...]:
    return tuple(DeviceHealth.from_payload(item, f"{name}[{i}]") for i, item in enumerate(_list(obj, name)))


@dataclass(frozen=True)
class HealthSnapshot:
    """The full health of one resource's devices at health sequence `seq`."""

    seq: int
    resource: str
    devices: tuple[DeviceHealth, ...]
    epoch: str = ""

    _FIELDS: ClassVar[tuple[str, ...]] = ("seq", "resource", "devices", "epoch")

    def to_payload(self) -> dict[str, Json]:
        return {
            "seq": self.seq,
            "resource": self.resource,
            "devices": [d.to_payload() for d in self.devices],
            "epoch": self.epoch,
        }

    @classmethod
    def from_payload(cls, raw: Json, path: str) -> HealthSnapshot:
        obj = _object(raw, f"field {path!r}")
        _only(obj, cls._FIELDS, path)
        devices = tuple(
            DeviceHealth.from_payload(item, f"{path}.devices[{i}]")
            for i, item in enumerate(_list(obj, "devices", path))
        )
        return cls(
            seq=_int(obj, "seq", path),
            resource=_str(obj, "resource", path),
            devices=devices,
            epoch=_str(obj, "epoch", path),
        )


# ---------------------------------------------------------------------------------------------
# Message kinds. Each declares its wire name (KIND), its topic, and how its payload maps.


@dataclass(frozen=True)
class HealthDelta:
    """PUB: devices whose health changed in the change batch numbered `seq`."""

    KIND: ClassVar[str] = "health-delta"
    TOPIC: ClassVar[bytes] = HEALTH_TOPIC

    seq: int
    changes: tuple[DeviceHealth, ...]
    epoch: str = ""

    def to_payload(self) -> dict[str, Json]:
        return {"seq": self.seq, "changes": [c.to_payload() for c in self.changes], "epoch": self.epoch}

    @classmethod
    def from_payload(cls, p: Mapping[str, Json]) -> HealthDelta:
        _only(p, ("seq", "changes", "epoch"), "payload")
        return cls(seq=_int(p, "seq"), changes=_health_list(p, "changes"), epoch=_str(p, "epoch"))


@dataclass(frozen=True)
class HealthBeacon(_Flat):
    """PUB, periodic: the current health sequence, so a subscriber can notice a lost last delta."""

    KIND: ClassVar[str] = "health-beacon"
    TOPIC: ClassVar[bytes] = HEALTH_TOPIC
    _FIELDS = (("seq", _int), ("epoch", _str))

    seq: int
    epoch: str = ""


@dataclass(frozen=True)
class Hello(_Flat):
    """Worker -> supervisor, first message on a new DEALER: who I am, and the proof.

    `secret` is the one the supervisor handed this process at spawn (over an inherited pipe or
    the zygote's socket, never the command line or the environment). A Hello with the right
    secret binds the DEALER's route to the worker; the supervisor takes worker messages from
    bound routes only.
    """

    KIND: ClassVar[str] = "hello"
    TOPIC: ClassVar[bytes] = CONTROL_TOPIC
    _FIELDS = (("resource", _str), ("pid", _int), ("secret", _str))

    resource: str
    pid: int
    secret: str


@dataclass(frozen=True)
class DraBeat:
    """The DRA worker's part of its heartbeat: where its drain and its claims stand.

    The supervisor decides on these (the device plugin is planned once the drain is confirmed,
    and again as its claims are unprepared; a change of the claims has the checkpoint read again
    for the claims' status), so they travel typed in every beat rather than among the figures.
    """

    draining: bool  # a draining plan is in force: new claims are refused, prepared ones unprepare
    prepared_claims: int  # the claims the worker's checkpoint lists
    claims_changes: int  # this process's checkpoint writes that added or dropped a claim

    _FIELDS: ClassVar[tuple[str, ...]] = ("draining", "prepared_claims", "claims_changes")

    def to_payload(self) -> dict[str, Json]:
        return {
            "draining": self.draining,
            "prepared_claims": self.prepared_claims,
            "claims_changes": self.claims_changes,
        }

    @classmethod
    def from_payload(cls, raw: Json, path: str) -> DraBeat:
        obj = _object(raw, f"field {path!r}")
        _only(obj, cls._FIELDS, path)
        return cls(
            draining=_bool(obj, "draining", path),
            prepared_claims=_int(obj, "prepared_claims", path),
            claims_changes=_int(obj, "claims_changes", path),
        )


def _dra_beat(obj: Mapping[str, Json], name: str) -> DraBeat | None:
    """A heartbeat's `dra`: null from a device-plugin worker, the DRA worker's part otherwise."""
    raw = _require(obj, name, "")
    return None if raw is None else DraBeat.from_payload(raw, name)


@dataclass(frozen=True)
class Heartbeat(_Flat):
    """Worker -> supervisor: liveness, state and metric data (a flat name -> number map), and
    from the DRA worker its `DraBeat` (`dra`, always present: null from a device-plugin worker).

    Sent periodically, and at once when the registration state, the socket, the number of
    ListAndWatch streams on the live server (`stats["gauge:streams"]`) or the DRA part changes,
    so the supervisor's view (status, readiness, planning) follows the worker within milliseconds.
    """

    KIND: ClassVar[str] = "heartbeat"
    TOPIC: ClassVar[bytes] = CONTROL_TOPIC
    _FIELDS = (
        ("resource", _str),
        ("pid", _int),
        ("state", _str),
        ("registered", _bool),
        ("socket_path", _str),
        ("stats", _number_dict),
        ("dra", _dra_beat),
    )

    resource: str
    pid: int
    state: str
    registered: bool
    socket_path: str
    stats: dict[str, float] = field(default_factory=dict)
    dra: DraBeat | None = None

    def to_payload(self) -> dict[str, Json]:
        out = super().to_payload()
        out["dra"] = None if self.dra is None else self.dra.to_payload()
        return out


@dataclass(frozen=True)
class StatusReport(_Flat):
    """Worker -> supervisor: something happened (registered, stream-started, stream-ended, ...)."""

    KIND: ClassVar[str] = "status"
    TOPIC: ClassVar[bytes] = CONTROL_TOPIC
    _FIELDS = (("resource", _str), ("event", _str), ("detail", _str))

    resource: str
    event: str
    detail: str = ""


@dataclass(frozen=True)
class SnapshotRequest(_Flat):
    """Worker -> supervisor: send me the health snapshot of my resource."""

    KIND: ClassVar[str] = "snapshot-request"
    TOPIC: ClassVar[bytes] = CONTROL_TOPIC
    _FIELDS = (("resource", _str),)

    resource: str


@dataclass(frozen=True)
class SnapshotReply:
    """Supervisor -> worker: the answer to a SnapshotRequest."""

    KIND: ClassVar[str] = "snapshot-reply"
    TOPIC: ClassVar[bytes] = CONTROL_TOPIC

    snapshot: HealthSnapshot

    def to_payload(self) -> dict[str, Json]:
        return {"snapshot": self.snapshot.to_payload()}

    @classmethod
    def from_payload(cls, p: Mapping[str, Json]) -> SnapshotReply:
        _only(p, ("snapshot",), "payload")
        return cls(snapshot=HealthSnapshot.from_payload(_require(p, "snapshot", ""), "snapshot"))


@dataclass(frozen=True)
class Reregister(_Flat):
    """Supervisor -> worker: start a new server on a new socket and register again."""

    KIND: ClassVar[str] = "reregister"
    TOPIC: ClassVar[bytes] = CONTROL_TOPIC
    _FIELDS = (("reason", _str),)

    reason: str


@dataclass(frozen=True)
class Shutdown(_Flat):
    """Supervisor -> worker: stop serving and exit cleanly."""

    KIND: ClassVar[str] = "shutdown"
    TOPIC: ClassVar[bytes] = CONTROL_TOPIC
    _FIELDS = ()


@dataclass(frozen=True)
class PlanUpdate:
    """Supervisor -> worker: the resource's plan changed; `plan_json` is `ResourcePlan.to_json()`.

    `snapshot` is the health of the new plan's devices, which the supervisor holds already: the
    worker takes plan and health as one change (a new device ID is never listed Healthy by
    default). None (no health book yet) makes the worker ask with a SnapshotRequest instead.
    """

    KIND: ClassVar[str] = "plan-update"
    TOPIC: ClassVar[bytes] = CONTROL_TOPIC

    plan_json: str
    snapshot: HealthSnapshot | None = None

    def to_payload(self) -> dict[str, Json]:
        return {
            "plan_json": self.plan_json,
            "snapshot": None if self.snapshot is None else self.snapshot.to_payload(),
        }

    @classmethod
    def from_payload(cls, p: Mapping[str, Json]) -> PlanUpdate:
        _only(p, ("plan_json", "snapshot"), "payload")
        raw = _require(p, "snapshot", "")
        snapshot = None if raw is None else HealthSnapshot.from_payload(raw, "snapshot")
        return cls(plan_json=_str(p, "plan_json"), snapshot=snapshot)


@dataclass(frozen=True)
class ClaimRequest(_Flat):
    """DRA worker -> supervisor: fetch this ResourceClaim from the API server for a prepare.

    The supervisor holds the one API client of the node (its credentials, rate limiter and
    counters); the worker names its request with `request_id` and waits for the `ClaimReply`.
    """

    KIND: ClassVar[str] = "claim-request"
    TOPIC: ClassVar[bytes] = CONTROL_TOPIC
    _FIELDS = (("resource", _str), ("request_id", _str), ("namespace", _str), ("name", _str))

    resource: str
    request_id: str
    namespace: str
    name: str


@dataclass(frozen=True)
class ClaimReply(_Flat):
    """Supervisor -> DRA worker: the claim as the API server served it (`claim_json`), or why not
    (`error`; `not_found` when the API server said there is no such claim)."""

    KIND: ClassVar[str] = "claim-reply"
    TOPIC: ClassVar[bytes] = CONTROL_TOPIC
    _FIELDS = (("request_id", _str), ("claim_json", _str), ("error", _str), ("not_found", _bool))

    request_id: str
    claim_json: str = ""
    error: str = ""
    not_found: bool = False


@dataclass(frozen=True)
class Command(_Flat):
    """CLI -> supervisor: a named command with JSON arguments (`status`, `sim-xid`, ...)."""

    KIND: ClassVar[str] = "command"
    TOPIC: ClassVar[bytes] = CONTROL_TOPIC
    _FIELDS = (("name", _str), ("args", _dict))

    name: str
    args: dict[str, Json] = field(default_factory=dict)


@dataclass(frozen=True)
class Reply(_Flat):
    """Supervisor -> CLI: the outcome of a Command."""

    KIND: ClassVar[str] = "reply"
    TOPIC: ClassVar[bytes] = CONTROL_TOPIC
    _FIELDS = (("ok", _bool), ("error", _str), ("data", _dict))

    ok: bool
    error: str = ""
    data: dict[str, Json] = field(default_factory=dict)


Message = (
    HealthDelta
    | HealthBeacon
    | Hello
    | Heartbeat
    | StatusReport
    | SnapshotRequest
    | SnapshotReply
    | Reregister
    | Shutdown
    | PlanUpdate
    | ClaimRequest
    | ClaimReply
    | MpsClaimRequest
    | MpsClaimReply
    | MigClaimRequest
    | MigClaimReply
    | Command
    | Reply
)

_ALL_KINDS: tuple[type[Message], ...] = get_args(Message)
# What a DRA worker asks the supervisor for and gets a reply to later: a claim, an MPS claim's
# daemon, a MIG device made on demand.
WorkerRequest = ClaimRequest | MpsClaimRequest | MigClaimRequest
_KINDS: dict[str, Callable[[Mapping[str, Json]], Message]] = {
    cls.KIND: cls.from_payload for cls in _ALL_KINDS
}
_KIND_TOPIC: dict[str, bytes] = {cls.KIND: cls.TOPIC for cls in _ALL_KINDS}

KINDS: tuple[str, ...] = tuple(_KINDS)


# ---------------------------------------------------------------------------------------------
# Envelope, encode, decode.


@dataclass(frozen=True)
class Envelope:
    """A decoded message with its envelope fields."""

    topic: bytes
    version: int
    seq: int
    time: float
    kind: str
    message: Message


class SequenceCounter:
    """A thread-safe, strictly increasing counter (1, 2, 3, ...) for one sender's messages."""

    def __init__(self, start: int = 0) -> None:
        if start < 0:
            raise ValueError(f"sequence start must be >= 0, got {start}")
        self._value = start
        self._lock = threading.Lock()

    @property
    def value(self) -> int:
        """The last number handed out (the start value if none yet)."""
        return self._value

    def next(self) -> int:
        with self._lock:
            self._value += 1
            return self._value


def encode(message: Message, *, seq: int, now: float | None = None) -> list[bytes]:
    """Frames `[topic, body]` for `message`; `seq` from the sender's SequenceCounter.

    Raises MessageError when the message holds what JSON cannot carry (NaN, sets, objects):
    that is a bug in the sender, caught here rather than at the receiver.
    """
    wall = time.time() if now is None else now
    body = {
        _K_VERSION: PROTOCOL_VERSION,
        _K_SEQ: seq,
        _K_TIME: wall,
        _K_KIND: message.KIND,
        _K_PAYLOAD: message.to_payload(),
    }
    try:
        text = json.dumps(body, separators=(",", ":"), allow_nan=False, ensure_ascii=False)
    except (TypeError, ValueError) as exc:
        raise MessageError(f"cannot encode {message.KIND} message: {exc}") from exc
    return [message.TOPIC, text.encode("utf-8")]


def _reject_constant(name: str) -> Json:
    raise MessageError(f"body has the non-JSON number {name}")


def _as_bytes(frame: object, which: str) -> bytes:
    if isinstance(frame, bytes):
        return frame
    if isinstance(frame, bytearray | memoryview):
        return bytes(frame)
    raise MessageError(f"{which} frame must be bytes, not {type(frame).__name__}")


def decode(frames: Sequence[object]) -> Envelope:
    """Parse `[topic, body]`; raises MessageError (and only that) for anything malformed."""
    try:
        return _decode(frames)
    except MessageError:
        raise
    # A last net, on purpose: whatever a peer sends must never take down a receive loop.
    # RecursionError comes from absurdly nested JSON; the others would be bugs in a reader.
    except (RecursionError, ValueError, TypeError, KeyError, AttributeError, OverflowError) as exc:
        raise MessageError(f"malformed message: {type(exc).__name__}: {exc}") from exc


def _decode(frames: Sequence[object]) -> Envelope:
    if isinstance(frames, bytes | bytearray | str) or not isinstance(frames, Sequence):
        raise MessageError(f"expected a list of 2 frames [topic, body], got {type(frames).__name__}")
    if len(frames) != 2:
        raise MessageError(f"expected 2 frames [topic, body], got {len(frames)}")
    topic = _as_bytes(frames[0], "topic")
    raw = _as_bytes(frames[1], "body")
    if topic not in _TOPICS:
        raise MessageError(f"unknown topic {topic[:40]!r}")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise MessageError(f"body is not UTF-8: {exc.reason} at byte {exc.start}") from exc
    try:
        body = json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:
        raise MessageError(f"body is not JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from exc
    envelope = _object(body, "body")
    version = _int(envelope, _K_VERSION, minimum=0)
    if version != PROTOCOL_VERSION:
        raise MessageError(
            f"protocol version {version} is not supported (this side speaks {PROTOCOL_VERSION})"
        )
    _only(envelope, _ENVELOPE_KEYS, "")
    seq = _int(envelope, _K_SEQ)
    wall = _float(envelope, _K_TIME)
    kind = _str(envelope, _K_KIND)
    reader = _KINDS.get(kind)
    if reader is None:
        raise MessageError(f"unknown message kind {kind[:60]!r}")
    if _KIND_TOPIC[kind] != topic:
        raise MessageError(f"kind {kind!r} does not belong on topic {topic!r}")
    payload = _object(_require(envelope, _K_PAYLOAD, ""), "field 'payload'")
    message = reader(payload)
    return Envelope(topic=topic, version=version, seq=seq, time=wall, kind=kind, message=message)


def split_routed(frames: Sequence[bytes]) -> tuple[list[bytes], list[bytes]]:
    """Split a ROUTER's frames into (routing frames, [topic, body]); reply with route + encode(...)."""
    if len(frames) < 2:
        raise MessageError(f"expected routing frames then [topic, body], got {len(frames)} frame(s)")
    return list(frames[:-2]), list(frames[-2:])
