"""What the NVML monitor thread found, as data, and the one place a finding meets the book.

The monitor thread (supervisor/health/monitor.py) never touches the health book: it reports
each finding as one of these small frozen dataclasses, which the supervisor's main loop applies
(`apply_finding`) to the book it alone writes. A finding is plain data, so it can be logged,
counted and tested on its own, and the dispatch on its kind is one `match`.

- `Xid`, `Ecc`: an NVML event on a GPU, or on one MIG instance of it (`gi`, `ci`);
- `Lost`: the GPU does not answer NVML (fell off the bus, or no longer visible);
- `Found`: a GPU that was lost answers again;
- `Probed`: a periodic health probe of a GPU passed or failed (with the reason);
- `WaitFailed`: the NVML event wait itself fails for a reason no probe explains: every GPU
  is suspect until waits work again;
- `Unattributed`: an event that named no GPU NVML can tell: logged, nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass

from supervisor.health.book import ChangeBatch, HealthBook
from supervisor.health.policy import EccKind


@dataclass(frozen=True)
class Xid:
    gpu_uuid: str
    xid: int
    gi: int | None = None
    ci: int | None = None


@dataclass(frozen=True)
class Ecc:
    gpu_uuid: str
    kind: EccKind
    gi: int | None = None
    ci: int | None = None


@dataclass(frozen=True)
class Lost:
    gpu_uuid: str
    detail: str


@dataclass(frozen=True)
class Found:
    gpu_uuid: str


@dataclass(frozen=True)
class Probed:
    gpu_uuid: str
    ok: bool
    reason: str = ""


@dataclass(frozen=True)
class WaitFailed:
    reason: str


@dataclass(frozen=True)
class Unattributed:
    event_type: int
    data: int


Finding = Xid | Ecc | Lost | Found | Probed | WaitFailed | Unattributed


def apply_finding(book: HealthBook, finding: Finding, now: float) -> ChangeBatch:
    """Apply one finding to the book (on the loop that owns it); what changed, maybe nothing."""
    match finding:
        case Xid(gpu_uuid, xid, gi, ci):
            return book.apply_xid(gpu_uuid, xid, gi, ci, now=now)
        case Ecc(gpu_uuid, kind, gi, ci):
            return book.apply_ecc(gpu_uuid, kind, gi, ci, now=now)
        case Lost(gpu_uuid, detail):
            return book.mark_lost(gpu_uuid, now, detail)
        case Found(gpu_uuid):
            return book.mark_found(gpu_uuid, now)
        case Probed(gpu_uuid, ok, reason):
            return book.probe_result(gpu_uuid, ok, reason, now)
        case WaitFailed(reason):
            return book.mark_all_unhealthy(reason, now)
        case Unattributed():
            return ChangeBatch(seq=book.seq, now=now, cause="an event that named no known GPU")
