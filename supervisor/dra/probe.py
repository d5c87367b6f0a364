"""Does the API server keep a ResourceSlice field behind a feature gate? `FieldProbe` asks once.

A kube-apiserver whose feature gate for a field is off drops the field from what it stores,
silently (the resourceslice strategy's dropDisabledFields, kubernetes
pkg/registry/resource/resourceslice/strategy.go): device taints without DRADeviceTaints (off in
1.34 and 1.35), `allowMultipleAllocations` and a capacity's `requestPolicy` without
DRAConsumableCapacity (alpha, off, in 1.34 and 1.35; beta, on, in 1.36). Before the first slice
that carries such a field is written, a dry-run create (`dryRun=All`: validated, defaulted, the
gates applied, nothing stored) of it shows whether the server keeps it; a real write whose answer
lacks the field it carried says the same. Where it is dropped the publisher builds the slices
without it (`supervisor.dra.publish` says what instead), says so once, loudly, and asks again at
each resync (an upgraded API server). The publisher's thread is the only caller.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Sequence
from typing import Any

from supervisor.kube.client import KubeClient

log = logging.getLogger("gpuvisor.dra")


class FieldProbe:
    def __init__(
        self,
        name: str,
        present: Callable[[Sequence[Any]], bool],
        *,
        kept: str,
        dropped: str,
        on_count: Callable[[str, str], None] = lambda what, result: None,
    ) -> None:
        self.name = name  # "taints", "sharing": the probe's count is `<name>-kept` / `<name>-dropped`
        self.present = present  # do these devices carry the field?
        self._kept, self._dropped = kept, dropped  # what is logged for each answer
        self.on_count = on_count
        self.state: bool | None = None  # kept? None: not asked yet

    def ask(self, client: KubeClient, path: str, obj: dict[str, Any], owner_ref: dict[str, Any]) -> bool:
        """A dry-run create of `obj` (which carries the field): does the server keep it?"""
        probe = copy.deepcopy(obj)
        probe["metadata"]["ownerReferences"] = [owner_ref]
        answer = client.request(
            "POST",
            path,
            what=f"probe whether the API server keeps {self._what()} (a dry-run create)",
            query={"dryRun": "All"},
            body=probe,
        )
        kept = isinstance(answer, dict) and self.present(_devices(answer))
        self.on_count("probe", f"{self.name}-{'kept' if kept else 'dropped'}")
        self.answered(kept)
        return kept

    def answered(self, kept: bool) -> None:
        if kept == self.state:
            return
        self.state = kept
        if kept:
            log.info("%s", self._kept)
        else:
            log.warning("%s", self._dropped)

    def took(self, sent: Sequence[Any], stored: Sequence[Any]) -> bool:
        """A write's answer: True when the field was sent and is not stored (the server drops it)."""
        if self.present(sent) and not self.present(stored):
            self.answered(False)
            return True
        return False

    def resync(self) -> None:
        if self.state is False:
            self.state = None  # ask again: the API server may have been upgraded

    def describe(self) -> str:
        return {None: "unknown", True: "kept", False: "dropped"}[self.state]

    def _what(self) -> str:
        return "device taints" if self.name == "taints" else f"the {self.name} fields"


def _devices(obj: dict[str, Any]) -> list[Any]:
    devices = (obj.get("spec") or {}).get("devices")
    return devices if isinstance(devices, list) else []


def server_version(client: KubeClient) -> tuple[int, int]:
    """The API server's (major, minor) from `/version` (k8s.io/apimachinery version.Info: `major`
    and `minor` strings, a minor like "35+" on some providers). Raises ApiError."""
    from supervisor.kube.errors import NO_ANSWER, ApiError

    answer = client.get("/version", what="read the API server's version (it decides the slices' layout)")
    info = answer if isinstance(answer, dict) else {}
    try:
        return int(str(info.get("major", ""))), int(str(info.get("minor", "")).rstrip("+"))
    except ValueError:
        raise ApiError(
            "read the API server's version", NO_ANSWER, "BadVersion", f"not a version: {str(info)[:120]}"
        ) from None
