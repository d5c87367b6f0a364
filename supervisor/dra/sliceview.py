"""What the publisher reads of ResourceSlice objects, and the listing of one node's: small helpers.

Apart from `supervisor.dra.publish` so that the publisher stays a readable size; `node_slices` is
also what `supervisor.dra.earlier` lists an earlier life's pool with.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from supervisor.kube.client import KubeClient
from supervisor.kube.errors import ApiError

PATH = "/apis/resource.k8s.io/v1/resourceslices"


def _devices(obj: Mapping[str, Any]) -> list[Any]:
    devices = (obj.get("spec") or {}).get("devices")
    return devices if isinstance(devices, list) else []


def _form(obj: Mapping[str, Any]) -> str:
    """What a pass compares of a slice: its devices and shared counters (not its pool's generation)."""
    spec = obj.get("spec") or {}
    content = {"devices": _devices(obj), "sharedCounters": spec.get("sharedCounters") or []}
    return json.dumps(content, sort_keys=True, separators=(",", ":"))


def _meta(obj: Mapping[str, Any]) -> dict[str, Any]:
    meta = obj.get("metadata")
    return meta if isinstance(meta, dict) else {}


def _pool(obj: Mapping[str, Any]) -> dict[str, Any]:
    pool = (obj.get("spec") or {}).get("pool")
    return pool if isinstance(pool, dict) else {}


def _generation(obj: Mapping[str, Any]) -> int:
    value = _pool(obj).get("generation")
    return value if isinstance(value, int) else 0


def _partitioned(devices: Sequence[Any]) -> bool:
    return any(isinstance(d, dict) and d.get("consumesCounters") for d in devices)


def _tainted(devices: Sequence[Any]) -> bool:
    return any(isinstance(d, dict) and d.get("taints") for d in devices)


def node_slices(client: KubeClient, node_name: str, driver: str) -> list[dict[str, Any]]:
    """The ResourceSlices of one node and driver at the API server, by name."""
    answer = client.get(
        PATH,
        what=f"list the ResourceSlices of Node {node_name}",
        query={"fieldSelector": f"spec.nodeName={node_name},spec.driver={driver}"},
    )
    items = answer.get("items") if isinstance(answer, dict) else None
    if not isinstance(items, list):
        raise ApiError("list ResourceSlices", 200, "BadList", "the answer is not a list")
    # The selector again: not every server (or proxy) honours field selectors.
    return sorted(
        (
            o
            for o in items
            if isinstance(o, dict)
            and (o.get("spec") or {}).get("nodeName") == node_name
            and (o.get("spec") or {}).get("driver") == driver
        ),
        key=lambda o: str(_meta(o).get("name", "")),
    )
