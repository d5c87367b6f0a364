"""The MPS control daemons of DRA claims (supervisor/mps/claims.py) against the fake
`nvidia-cuda-mps-control` of tests/mpsfake.py: real daemon processes, started for a claim, probed,
restarted, stopped, adopted by a second supervisor life, and cleaned up when the DRA checkpoint
does not hold their claim.

What the daemon is told follows NVIDIA's kubelet plugin v0.4.1 (kubernetes-sigs/dra-driver-nvidia-gpu,
templates/mps-control-daemon.tmpl.yaml: CUDA_VISIBLE_DEVICES, `set_default_active_thread_percentage`
then `set_default_device_pinned_mem_limit <uuid> <MiB>M`; cmd/gpu-kubelet-plugin/sharing.go,
GetMpsControlDaemonID and GetCDIContainerEdits).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common.dracheckpoint import Checkpoint, PreparedClaim, PreparedDevice
from common.mpsmessages import MpsClaimReply, MpsClaimRequest
from supervisor.mps.claims import ClaimDaemons, daemon_id
from supervisor.mps.daemons import MpsDaemons
from tests.helpers import wait_until
from tests.mpsfake import behave, dead

UID = "0b0e7c6e-3f4a-4b7e-9a55-6c1f0d2e8a11"
GPUS = ("GPU-11111111-2222-3333-4444-555555555555", "GPU-66666666-7777-8888-9999-000000000000")
WORKER = "gpu.nvidia.com"


class Claims:
    """One supervisor life's claim daemons, ticked by the test; the answers it sent."""

    def __init__(self, tmp_path: Path, fake: Path, **kwargs: Any) -> None:
        self.root = tmp_path / "mps" / "dra"
        self.plugin = tmp_path / "plugin"
        self.engine = MpsDaemons(
            lambda key, up, reason: None,
            binary=str(fake),
            backoff_initial=0.0,
            probe_interval=0.2,
            command_timeout=5.0,
            start_timeout=10.0,
        )
        self.replies: list[tuple[str, MpsClaimReply]] = []
        self.daemons = ClaimDaemons(
            claims_root=str(self.root),
            checkpoint_path=str(self.plugin / "checkpoint.json"),
            engine=self.engine,
            answer=lambda resource, reply: self.replies.append((resource, reply)),
            **kwargs,
        )
        self._ids = 0

    def tick_until(self, predicate: Callable[[], object], timeout: float = 20.0) -> bool:
        def step() -> bool:
            self.daemons.tick(time.monotonic(), time.time())
            return bool(predicate())

        return wait_until(step, timeout, interval=0.02)

    def ask(self, action: str, uid: str = UID, **fields: Any) -> MpsClaimReply:
        self._ids += 1
        request_id = str(self._ids)
        self.daemons.request(MpsClaimRequest(WORKER, request_id, action, uid, **fields))
        assert self.tick_until(lambda: any(r.request_id == request_id for _, r in self.replies))
        return next(r for _, r in self.replies if r.request_id == request_id)

    def start(self, uid: str = UID, **fields: Any) -> MpsClaimReply:
        fields.setdefault("gpu_uuids", ",".join(GPUS))
        return self.ask("start", uid, **fields)


def daemon_dir(claims: Claims, uid: str = UID, gpus: tuple[str, ...] = GPUS) -> Path:
    digest = hashlib.sha256(",".join(gpus).encode()).hexdigest()[:5]
    return claims.root / f"{uid}-{digest}"


def recorded(home: Path) -> list[str]:
    path = home / "log" / "fake-commands.log"
    return path.read_text().splitlines() if path.exists() else []


def pids(home: Path) -> list[int]:
    return [int(line.split()[1]) for line in recorded(home) if line.startswith("daemon-start ")]


def prepared(claims: Claims, *uids: str) -> None:
    """The DRA worker's checkpoint holds these claims."""
    checkpoint = Checkpoint(str(claims.plugin))
    checkpoint.load()
    checkpoint.drop([c for c in [UID, "other-claim"] if c not in uids])
    device = PreparedDevice(("gpu",), "node", "gpu-0", ("k8s.gpu.nvidia.com/device=gpu-0",))
    checkpoint.put([PreparedClaim(uid, "default", f"claim-{uid}", (device,), time.time()) for uid in uids])
    claims.daemons.checkpoint_changed()


def test_start_is_answered_once_the_limits_are_set(tmp_path: Path, fake: Path) -> None:
    """A start answers only once the daemon runs with CUDA_VISIBLE_DEVICES, its pipe and log dirs
    and NVIDIA's limit commands in NVIDIA's order (thread share, then per-UUID MiB); the answer
    names the claim's own pipe and shm dirs under <root>/<uid>-<sha256[:5]> (NVIDIA's ID)."""
    claims = Claims(tmp_path, fake)
    reply = claims.start(thread_percentage=40, pinned_limits={GPUS[0]: 1024, GPUS[1]: 2048})
    home = daemon_dir(claims)
    assert reply == MpsClaimReply("1", "", str(home / "pipe"), str(home / "shm"))
    assert (
        recorded(home)[1:3]
        == [
            "set_default_active_thread_percentage 40",
            f"set_default_device_pinned_mem_limit {GPUS[0]} 1024M",
        ]
        and recorded(home)[3] == f"set_default_device_pinned_mem_limit {GPUS[1]} 2048M"
    )
    pid = pids(home)[0]
    environ = (Path(f"/proc/{pid}/environ").read_bytes()).split(b"\0")
    assert f"CUDA_VISIBLE_DEVICES={','.join(GPUS)}".encode() in environ
    assert f"CUDA_MPS_PIPE_DIRECTORY={home / 'pipe'}".encode() in environ
    assert f"CUDA_MPS_LOG_DIRECTORY={home / 'log'}".encode() in environ
    assert (home / ".started").exists() and oct((home / "shm").stat().st_mode & 0o7777) == "0o1777"
    record = json.loads((home / "claim.json").read_text())
    assert record["claimUID"] == UID and record["pinnedMemoryLimitsMiB"] == {GPUS[0]: 1024, GPUS[1]: 2048}
    # A repeated start (a prepare the kubelet asks again) is answered at once, same daemon.
    assert claims.start(thread_percentage=40, pinned_limits={GPUS[0]: 1024, GPUS[1]: 2048}).pipe_dir
    assert pids(home) == [pid]
    status = claims.daemons.status()["daemons"][home.name]
    assert status["up"] and status["pid"] == pid and status["claim_uid"] == UID


def test_unset_limits_send_no_command(tmp_path: Path, fake: Path) -> None:
    """An MpsConfig without limits starts the daemon and sends it no set_ command (the template's ifs)."""
    claims = Claims(tmp_path, fake)
    assert not claims.start(gpu_uuids=GPUS[0]).error
    home = daemon_dir(claims, gpus=GPUS[:1])
    assert [c for c in recorded(home) if c.startswith("set_")] == []


def test_killed_daemon_is_restarted_with_its_limits(tmp_path: Path, fake: Path) -> None:
    """A claim daemon that dies is started again and told its limits again; it stays the claim's."""
    claims = Claims(tmp_path, fake)
    claims.start(thread_percentage=25)
    prepared(claims, UID)
    home = daemon_dir(claims)
    first = pids(home)[0]
    os.kill(first, signal.SIGKILL)
    assert claims.tick_until(
        lambda: len(pids(home)) == 2 and claims.daemons.status()["daemons"][home.name]["up"]
    )
    assert recorded(home).count("set_default_active_thread_percentage 25") == 2
    assert claims.daemons.status()["daemons"][home.name]["restarts"] == 1
    assert dead(first)


def test_stop_ends_the_daemon_and_removes_its_directory(tmp_path: Path, fake: Path) -> None:
    """A stop (an unprepare) is answered once the claim's daemon has quit and its dir is gone;
    a stop of a claim with no daemon is a success too."""
    claims = Claims(tmp_path, fake)
    claims.start()
    home = daemon_dir(claims)
    pid = pids(home)[0]
    assert claims.ask("stop") == MpsClaimReply("2")
    assert dead(pid) and not home.exists()
    assert claims.daemons.status()["daemons"] == {}
    assert claims.ask("stop") == MpsClaimReply("3")


def test_failed_start_leaves_nothing_behind(tmp_path: Path, fake: Path) -> None:
    """A daemon that refuses its limits fails the start with the command and the answer, and is
    stopped and its directory removed before the answer."""
    claims = Claims(tmp_path, fake)
    behave(fake, "refuse")
    reply = claims.start(thread_percentage=30)
    assert "refused" in reply.error and "set_default_active_thread_percentage 30" in reply.error
    assert reply.error.startswith(f"claim {UID}: MPS control daemon: ")
    assert not daemon_dir(claims).exists() and claims.daemons.status()["daemons"] == {}


def test_bad_requests_are_refused_before_any_path(tmp_path: Path, fake: Path) -> None:
    """A UID that is no safe path, a percentage outside 1-100, a limit for a GPU not in the claim:
    each refused with why, nothing made under the root."""
    claims = Claims(tmp_path, fake)
    assert "is not a UID" in claims.start("../etc").error
    assert "not within 1-100" in claims.start(thread_percentage=101).error
    assert "not one of its GPUs" in claims.start(pinned_limits={"GPU-x": 5}).error
    assert "not a GPU UUID" in claims.start(gpu_uuids="nvidia0").error
    assert not claims.root.exists()


def test_a_second_life_adopts_the_daemon(tmp_path: Path, fake: Path) -> None:
    """After the supervising side restarts (a new ClaimDaemons reading the same root and
    checkpoint), a prepared claim's live daemon is adopted: same PID, its limits sent again, up."""
    claims = Claims(tmp_path, fake)
    claims.start(thread_percentage=50)
    prepared(claims, UID)
    home = daemon_dir(claims)
    pid = pids(home)[0]
    claims.daemons.shutdown()  # the supervisor's shutdown leaves it running
    assert not dead(pid)

    again = Claims(tmp_path, fake)
    again.daemons.load(time.time())
    assert again.tick_until(lambda: again.daemons.status()["daemons"].get(home.name, {}).get("up"))
    assert pids(home) == [pid] and again.daemons.status()["daemons"][home.name]["pid"] == pid
    assert recorded(home).count("set_default_active_thread_percentage 50") == 2


def test_daemon_of_a_claim_not_in_the_checkpoint_is_cleaned_up(tmp_path: Path, fake: Path) -> None:
    """A daemon whose claim never reached the checkpoint (a crash between start and checkpoint
    write) is stopped by the next life once its grace is over; a prepared one beside it stays."""
    claims = Claims(tmp_path, fake)
    claims.start()
    claims.start("other-claim")
    prepared(claims, "other-claim")
    orphan, kept = daemon_dir(claims), daemon_dir(claims, "other-claim")
    orphan_pid, kept_pid = pids(orphan)[0], pids(kept)[0]
    claims.daemons.shutdown()

    again = Claims(tmp_path, fake, grace=0.0)
    again.daemons.load(time.time())
    assert again.tick_until(lambda: not orphan.exists())
    assert dead(orphan_pid) and not dead(kept_pid)
    assert list(again.daemons.status()["daemons"]) == [kept.name]


def test_an_unprepared_claim_is_stopped_without_a_stop(tmp_path: Path, fake: Path) -> None:
    """A claim the checkpoint dropped (an unprepare whose stop was lost) loses its daemon once the
    grace of its start is over."""
    claims = Claims(tmp_path, fake, grace=0.0)  # no grace: the checkpoint alone decides
    claims.start()
    prepared(claims, UID)
    home = daemon_dir(claims)
    pid = pids(home)[0]
    assert claims.tick_until(lambda: claims.daemons.status()["daemons"][home.name]["up"])
    prepared(claims)
    assert claims.tick_until(lambda: not home.exists())
    assert dead(pid)


# --- who wants a daemon, with the wall clock driven by hand ------------------------------------


def _claims(tmp_path: Path, fake: Path, grace: float) -> tuple[ClaimDaemons, list[MpsClaimReply]]:
    replies: list[MpsClaimReply] = []
    engine = MpsDaemons(lambda *a: None, binary=str(fake), backoff_initial=0.0, probe_interval=60.0)
    daemons = ClaimDaemons(
        claims_root=str(tmp_path / "dra"),
        checkpoint_path=str(tmp_path / "plugin" / "checkpoint.json"),
        engine=engine,
        answer=lambda resource, reply: replies.append(reply),
        grace=grace,
        checkpoint_every=0.0,
    )
    return daemons, replies


def _tick_until_answered(daemons: ClaimDaemons, replies: list[MpsClaimReply], wall: float) -> None:
    deadline = time.monotonic() + 20
    while not replies and time.monotonic() < deadline:  # the daemon takes a moment to write its pid
        daemons.tick(time.monotonic(), wall)
    assert replies and not replies[-1].error, replies


def test_a_fresh_start_is_kept_for_its_grace_then_needs_the_checkpoint(tmp_path: Path, fake: Path) -> None:
    """With the wall clock by hand: a started claim not in the checkpoint runs until its grace
    (from the start request) is over, then is stopped and its directory removed."""
    daemons, replies = _claims(tmp_path, fake, grace=90.0)
    daemons.request(MpsClaimRequest("w", "1", "start", UID, GPUS[0]))
    _tick_until_answered(daemons, replies, wall=1000.0)
    home = tmp_path / "dra" / daemon_id(UID, (GPUS[0],))
    daemons.tick(time.monotonic(), 1089.0)
    assert home.exists() and daemons.counts() == (1, 0)
    daemons.tick(time.monotonic(), 1091.0)
    assert not home.exists() and daemons.counts() == (0, 0)


def test_an_unreadable_checkpoint_stops_nothing(tmp_path: Path, fake: Path) -> None:
    """A prepared claim's daemon stays while the checkpoint cannot be read (torn, not ours):
    the last claims read still count."""
    daemons, replies = _claims(tmp_path, fake, grace=0.0)
    checkpoint = Checkpoint(str(tmp_path / "plugin"))
    device = PreparedDevice(("r",), "pool", "gpu-0", ("k8s.gpu.nvidia.com/device=gpu-0",))
    checkpoint.put([PreparedClaim(UID, "ns", "c", (device,), 1.0)])
    daemons.request(MpsClaimRequest("w", "1", "start", UID, GPUS[0]))
    _tick_until_answered(daemons, replies, wall=1000.0)
    (tmp_path / "plugin" / "checkpoint.json").write_text("{torn")
    daemons.tick(time.monotonic(), 5000.0)
    assert daemons.counts() == (1, 0)
    checkpoint.drop([UID])  # readable again, without the claim: now it goes
    daemons.tick(time.monotonic(), 5001.0)
    assert daemons.counts() == (0, 0)


def test_a_gpus_memory_share_daemon_lives_while_any_claim_shares_the_gpu(tmp_path: Path, fake: Path) -> None:
    """The daemon of a GPU shared by memory (owner memshare-<GPU UUID>, common/dracheckpoint.py)
    is kept, without any grace, while a checkpointed claim shares that GPU by memory, whichever
    claim it is, and stopped once none does."""
    from common.dracheckpoint import MEMORY_SHARE, DeviceSharing, memory_share_uid

    claims = Claims(tmp_path, fake, grace=0.0)
    owner = memory_share_uid(GPUS[0])
    assert claims.start(owner, gpu_uuids=GPUS[0]).error == ""
    home = daemon_dir(claims, owner, (GPUS[0],))
    assert recorded(home)[1:] == []  # no daemon-wide limit: each client brings its own

    def shares(*uids: str) -> None:
        checkpoint = Checkpoint(str(claims.plugin))
        checkpoint.load()
        checkpoint.drop(c.uid for c in checkpoint.claims())
        sharing = DeviceSharing(MEMORY_SHARE, GPUS[0], GPUS[0], pinned_memory_limit=4 << 30)
        device = PreparedDevice(
            ("gpu",), "node", "gpu-0", ("k8s.gpu.nvidia.com/claim=x",), "s", sharing=sharing
        )
        checkpoint.put([PreparedClaim(uid, "default", f"c-{uid}", (device,), time.time()) for uid in uids])
        claims.daemons.checkpoint_changed()

    shares("claim-a", "claim-b")
    pid = pids(home)[0]
    shares("claim-b")  # the claim that started it is gone; another still shares the GPU
    assert not claims.tick_until(lambda: dead(pid), timeout=1.0)
    shares()
    assert claims.tick_until(lambda: dead(pid) and not home.exists())
