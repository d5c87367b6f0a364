"""Tests of the ZeroMQ wire format (common/messages.py): round trips, strict decoding, fuzzing."""

from __future__ import annotations

import contextlib
import json
import threading
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.messages import (
    CONTROL_TOPIC,
    HEALTH_TOPIC,
    KINDS,
    PROTOCOL_VERSION,
    ClaimReply,
    ClaimRequest,
    Command,
    DeviceHealth,
    DraBeat,
    HealthBeacon,
    HealthDelta,
    HealthSnapshot,
    Heartbeat,
    Hello,
    Message,
    MessageError,
    PlanUpdate,
    Reply,
    Reregister,
    SequenceCounter,
    Shutdown,
    SnapshotReply,
    SnapshotRequest,
    StatusReport,
    decode,
    encode,
    split_routed,
)
from common.migmessages import MigClaimReply, MigClaimRequest
from common.mpsmessages import MpsClaimReply, MpsClaimRequest

GOOD = DeviceHealth("GPU-a", True, "", 1.5)
BAD = DeviceHealth("GPU-b::1", False, "XID 79: GPU has fallen off the bus [until-reset]", 2.0)

EXAMPLES: list[Message] = [
    HealthDelta(seq=7, changes=(GOOD, BAD), epoch="e1"),
    HealthDelta(seq=0, changes=()),
    HealthBeacon(seq=9, epoch="e1"),
    Hello(resource="nvidia.com/gpu", pid=1234, secret="5e1f"),
    Heartbeat(
        resource="nvidia.com/gpu",
        pid=1234,
        state="serving",
        registered=True,
        socket_path="/var/lib/kubelet/device-plugins/gpuvisor-gpu-1.sock",
        stats={"allocate_total": 3, "allocate_seconds_sum": 0.25},
    ),
    Heartbeat(
        resource="gpu.nvidia.com",
        pid=1235,
        state="registered",
        registered=True,
        socket_path="/var/lib/kubelet/plugins/gpu.nvidia.com/dra.sock",
        dra=DraBeat(draining=True, prepared_claims=2, claims_changes=5),
    ),
    StatusReport(resource="nvidia.com/gpu", event="registered", detail="socket gpuvisor-gpu-1.sock"),
    SnapshotRequest(resource="nvidia.com/mig-1g.10gb"),
    SnapshotReply(HealthSnapshot(seq=3, resource="nvidia.com/gpu", devices=(GOOD, BAD), epoch="e1")),
    Reregister(reason="kubelet.sock created"),
    Shutdown(),
    PlanUpdate(plan_json='{"resource":"nvidia.com/gpu","devices":[]}'),
    PlanUpdate(
        plan_json="{}", snapshot=HealthSnapshot(seq=4, resource="nvidia.com/gpu", devices=(BAD,), epoch="e1")
    ),
    ClaimRequest(resource="gpu.nvidia.com", request_id="7", namespace="default", name="pod-gpu-x2"),
    ClaimReply(request_id="7", claim_json='{"kind":"ResourceClaim"}'),
    ClaimReply(request_id="8", error='resourceclaims "c" not found', not_found=True),
    MpsClaimRequest(
        resource="gpu.nvidia.com",
        request_id="9",
        action="start",
        claim_uid="0b0e7c6e-3f4a-4b7e-9a55-6c1f0d2e8a11",
        gpu_uuids="GPU-0,GPU-1",
        thread_percentage=50,
        pinned_limits={"GPU-0": 1024.0},
    ),
    MpsClaimRequest(resource="gpu.nvidia.com", request_id="10", action="stop", claim_uid="u"),
    MpsClaimReply(request_id="9", pipe_dir="/run/nvidia/mps/dra/u-1a2b3/pipe", shm_dir="/x/shm"),
    MpsClaimReply(request_id="10", error="no MPS control binary"),
    MigClaimRequest(
        resource="gpu.nvidia.com",
        request_id="11",
        action="create",
        claim_uid="u",
        gpu_uuid="GPU-1",
        gi_profile_id=19,
        placement_start=6,
        worker_pid=4242,
    ),
    MigClaimRequest("gpu.nvidia.com", "12", "destroy", "u", "GPU-1", gi_id=13, ci_id=0),
    MigClaimReply(request_id="11", uuid="MIG-9", gi_id=13, ci_id=0),
    MigClaimReply(request_id="12", error="GPU instance 13 is in use"),
    Command(name="sim-xid", args={"gpu": 0, "xid": 79, "nested": {"a": [1, 2, None]}}),
    Reply(ok=False, error="no GPU with index 9", data={}),
    Reply(ok=True, data={"workers": [{"resource": "nvidia.com/gpu", "state": "RUNNING"}]}),
]


def body(**overrides: Any) -> bytes:
    envelope: dict[str, Any] = {
        "v": PROTOCOL_VERSION,
        "seq": 1,
        "time": 10.0,
        "kind": "reregister",
        "payload": {"reason": "x"},
    }
    for key, value in overrides.items():
        if value is _DROP:
            envelope.pop(key)
        else:
            envelope[key] = value
    return json.dumps(envelope).encode()


_DROP = object()


def heartbeat_body(dra: Any) -> bytes:
    """A heartbeat's body whose `dra` field is `dra` (`_DROP`: left out)."""
    payload: dict[str, Any] = {
        "resource": "gpu.nvidia.com",
        "pid": 1,
        "state": "registered",
        "registered": True,
        "socket_path": "",
        "stats": {},
    }
    if dra is not _DROP:
        payload["dra"] = dra
    return body(kind="heartbeat", payload=payload)


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(message: Message) -> None:
    """Every kind encodes to [topic, body] and decodes to an equal message with its envelope."""
    frames = encode(message, seq=42, now=123.5)
    assert len(frames) == 2
    assert frames[0] == message.TOPIC
    env = decode(frames)
    assert env.message == message
    assert (env.seq, env.time, env.kind, env.version, env.topic) == (
        42,
        123.5,
        message.KIND,
        PROTOCOL_VERSION,
        message.TOPIC,
    )


def test_every_kind_has_an_example() -> None:
    """The round-trip table covers every registered message kind."""
    assert {m.KIND for m in EXAMPLES} == set(KINDS)


def test_body_is_compact_json() -> None:
    """The body is compact JSON (no spaces between tokens) with the envelope keys."""
    frames = encode(Reregister(reason="a b"), seq=1, now=2.0)
    text = frames[1].decode()
    assert ", " not in text and ": " not in text
    assert set(json.loads(text)) == {"v", "seq", "time", "kind", "payload"}


def test_topics() -> None:
    """Health kinds travel on b"health", everything else on b"control"."""
    assert HealthDelta.TOPIC == HealthBeacon.TOPIC == HEALTH_TOPIC
    assert {m.TOPIC for m in EXAMPLES if not isinstance(m, HealthDelta | HealthBeacon)} == {CONTROL_TOPIC}


def test_a_device_plugin_heartbeat_says_dra_null() -> None:
    """A heartbeat without a DRA part carries `"dra": null`, and decodes to none: the field is
    always on the wire, so a heartbeat that lacks it is refused as malformed."""
    frames = encode(Heartbeat("nvidia.com/gpu", 1, "registered", True, "/p"), seq=1, now=2.0)
    assert json.loads(frames[1])["payload"]["dra"] is None
    message = decode(frames).message
    assert isinstance(message, Heartbeat) and message.dra is None


def test_encode_rejects_nan() -> None:
    """A sender cannot put NaN (not JSON) on the wire: encode raises MessageError."""
    hb = Heartbeat("r", 1, "s", True, "/p", stats={"x": float("nan")})
    with pytest.raises(MessageError, match="cannot encode heartbeat"):
        encode(hb, seq=1)


MALFORMED: list[tuple[str, Any, str]] = [
    ("one frame", [CONTROL_TOPIC], "expected 2 frames"),
    ("three frames", [CONTROL_TOPIC, body(), b""], "expected 2 frames"),
    ("not a list", b"control", "expected a list"),
    ("str frame", [CONTROL_TOPIC, "text"], "body frame must be bytes"),
    ("unknown topic", [b"other", body()], "unknown topic"),
    ("non-utf8", [CONTROL_TOPIC, b"\xff\xfe{}"], "not UTF-8"),
    ("bad json", [CONTROL_TOPIC, b"{"], "not JSON"),
    ("json array", [CONTROL_TOPIC, b"[]"], "body must be a JSON object"),
    ("NaN constant", [CONTROL_TOPIC, body(time=None).replace(b"null", b"NaN")], "non-JSON number"),
    ("huge number", [CONTROL_TOPIC, body(time=None).replace(b"null", b"1e999")], "finite"),
    ("wrong version", [CONTROL_TOPIC, body(v=PROTOCOL_VERSION + 1)], "protocol version"),
    ("missing version", [CONTROL_TOPIC, body(v=_DROP)], "missing field 'v'"),
    ("bool version", [CONTROL_TOPIC, body(v=True)], "'v' must be an integer"),
    ("negative seq", [CONTROL_TOPIC, body(seq=-1)], "'seq' must be >= 0"),
    ("string time", [CONTROL_TOPIC, body(time="now")], "'time' must be a number"),
    ("unknown kind", [CONTROL_TOPIC, body(kind="explode")], "unknown message kind"),
    ("wrong topic", [HEALTH_TOPIC, body()], "does not belong on topic"),
    ("extra envelope", [CONTROL_TOPIC, body(extra=1)], "unexpected field"),
    ("missing payload", [CONTROL_TOPIC, body(payload=_DROP)], "missing field 'payload'"),
    ("payload list", [CONTROL_TOPIC, body(payload=[])], "payload"),
    ("missing field", [CONTROL_TOPIC, body(payload={})], "missing field 'reason'"),
    ("extra field", [CONTROL_TOPIC, body(payload={"reason": "x", "why": 1})], "unexpected field"),
    ("wrong type", [CONTROL_TOPIC, body(payload={"reason": 5})], "'reason' must be a string"),
    (
        "bad nested record",
        [
            HEALTH_TOPIC,
            body(kind="health-delta", payload={"seq": 1, "epoch": "", "changes": [{"device_id": 1}]}),
        ],
        "changes[0]",
    ),
    (
        "stats not numbers",
        [
            CONTROL_TOPIC,
            body(
                kind="heartbeat",
                payload={
                    "resource": "r",
                    "pid": 1,
                    "state": "s",
                    "registered": True,
                    "socket_path": "",
                    "stats": {"a": "b"},
                },
            ),
        ],
        "stats.a",
    ),
    (
        "snapshot devices not a list",
        [
            CONTROL_TOPIC,
            body(
                kind="snapshot-reply",
                payload={"snapshot": {"seq": 1, "resource": "r", "epoch": "", "devices": {}}},
            ),
        ],
        "must be a list",
    ),
    ("heartbeat without dra", [CONTROL_TOPIC, heartbeat_body(_DROP)], "missing field 'dra'"),
    ("dra not an object", [CONTROL_TOPIC, heartbeat_body(1)], "field 'dra' must be a JSON object"),
    (
        "dra draining a number",
        [CONTROL_TOPIC, heartbeat_body({"draining": 1, "prepared_claims": 0, "claims_changes": 0})],
        "'dra.draining' must be a boolean",
    ),
    (
        "dra claims negative",
        [CONTROL_TOPIC, heartbeat_body({"draining": False, "prepared_claims": -1, "claims_changes": 0})],
        "'dra.prepared_claims' must be >= 0",
    ),
    (
        "dra extra field",
        [
            CONTROL_TOPIC,
            heartbeat_body({"draining": False, "prepared_claims": 0, "claims_changes": 0, "x": 1}),
        ],
        "unexpected field(s) 'x' in 'dra'",
    ),
    ("deep nesting", [CONTROL_TOPIC, b"[" * 100_000 + b"]" * 100_000], ""),
]


@pytest.mark.parametrize(("case", "frames", "reason"), MALFORMED, ids=[c[0] for c in MALFORMED])
def test_malformed_is_message_error(case: str, frames: Any, reason: str) -> None:
    """Each kind of malformed input raises MessageError naming what is wrong."""
    with pytest.raises(MessageError) as info:
        decode(frames)
    assert reason in str(info.value), case


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.binary(max_size=200), max_size=4))
def test_fuzz_random_frames(frames: list[bytes]) -> None:
    """Random frames never raise anything but MessageError."""
    with contextlib.suppress(MessageError):
        decode(frames)


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=10,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    topic=st.sampled_from([HEALTH_TOPIC, CONTROL_TOPIC]),
    kind=st.sampled_from([*KINDS, "nope"]),
    payload=_json,
    seq=_json,
    when=_json,
)
def test_fuzz_structured_envelopes(topic: bytes, kind: str, payload: Any, seq: Any, when: Any) -> None:
    """Well-formed JSON with random field values never raises anything but MessageError."""
    raw = json.dumps(
        {"v": PROTOCOL_VERSION, "seq": seq, "time": when, "kind": kind, "payload": payload}
    ).encode()
    with contextlib.suppress(MessageError):
        decode([topic, raw])


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(EXAMPLES), st.integers(min_value=0, max_value=200), st.binary(min_size=1, max_size=3))
def test_fuzz_corrupted_valid_messages(message: Message, cut: int, junk: bytes) -> None:
    """A valid body that is truncated or has bytes spliced in never raises anything but MessageError."""
    topic, raw = encode(message, seq=1, now=1.0)
    for mangled in (raw[:cut], raw[:cut] + junk + raw[cut:]):
        with contextlib.suppress(MessageError):
            decode([topic, mangled])


def test_split_routed() -> None:
    """A ROUTER's frames split into routing frames and [topic, body]; too few frames is an error."""
    frames = encode(Shutdown(), seq=1)
    route, rest = split_routed([b"id", *frames])
    assert route == [b"id"]
    assert decode(rest).message == Shutdown()
    with pytest.raises(MessageError):
        split_routed([b"only"])


def test_sequence_counter_is_monotonic_across_threads() -> None:
    """SequenceCounter hands out each number once, increasing, even from several threads."""
    counter = SequenceCounter()
    seen: list[int] = []
    lock = threading.Lock()

    def grab() -> None:
        mine = [counter.next() for _ in range(500)]
        assert mine == sorted(mine)
        with lock:
            seen.extend(mine)

    threads = [threading.Thread(target=grab) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(seen) == list(range(1, 2001))
    assert counter.value == 2000
