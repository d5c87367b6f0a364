"""resource.k8s.io/v1 ResourceSlices (cluster-scoped), with the registry's rules.

get, list and watch (by `spec.nodeName`, `spec.driver`, `metadata.name`); create with
`generateName` (names.SimpleNameGenerator's random suffix); update with optimistic concurrency and
the immutable driver, pool name and node name; delete with `preconditions`; deletecollection, as the
kubelet wipes a node's slices; `dryRun=All`. Each object is checked by
validation.resource_slice_problems; without the DRADeviceTaints gate (`device_taints=False`)
`devices[].taints` are dropped on write (dropDisabledDRADeviceTaintsFields), and without
DRAConsumableCapacity (`consumable_capacity=False`, 1.34's and 1.35's default) a device's
`allowMultipleAllocations` and its capacities' `requestPolicy` (capacity.drop_consumable_capacity),
and without DRAPartitionableDevices (`partitionable_devices=False`, 1.33's to 1.35's default)
`sharedCounters`, `perDeviceNodeSelection` and the devices' `consumesCounters` and node selection
(partitions.drop_partitionable); on update each is kept where the stored slice already uses it.
"""

from __future__ import annotations

import copy
import random
import uuid
from typing import Any

from tests.kubeapi.capacity import drop_consumable_capacity, uses_consumable_capacity
from tests.kubeapi.listwatch import ListWatch
from tests.kubeapi.partitions import drop_partitionable, uses_partitionable
from tests.kubeapi.resources import RESOURCE_GROUP, status
from tests.kubeapi.state import now_rfc3339
from tests.kubeapi.validation import drop_taints, resource_slice_problems

GENERATED_SUFFIX = 5  # the API server's names.SimpleNameGenerator


class SliceHandler(ListWatch):
    """resource.k8s.io/v1 ResourceSlices."""

    def _slice(self, method: str, name: str | None, query: dict[str, str], body: Any) -> None:
        """resource.k8s.io/v1 ResourceSlices (cluster-scoped): get, list, watch, create (with
        generateName), update, delete (with preconditions), deletecollection, and `dryRun=All`."""
        state = self.state
        dry = query.get("dryRun") == "All"
        if method == "GET":
            if name is None:
                watching = query.get("watch") in ("true", "1")
                if self._allowed("watch" if watching else "list", "resourceslices"):

                    def current() -> list[dict[str, Any]]:
                        return list(state.resource_slices.values())

                    if watching:
                        self._watch("resourceslices", current, query)
                    else:
                        with state.lock:
                            objects = current()
                        self._list("resourceslices", objects, query)
                return
            if self._allowed("get", "resourceslices", name=name):
                with state.lock:
                    found = copy.deepcopy(state.resource_slices.get(name))
                self._send(200, found) if found else self._not_found("resourceslices", name)
            return
        if method == "DELETE":
            self._delete_slices(name, query, body, dry)
            return
        if method == "POST" and name is None:
            if self._allowed("create", "resourceslices"):
                self._create_slice(body, dry)
            return
        if method == "PUT" and name is not None:
            if self._allowed("update", "resourceslices", name=name):
                self._update_slice(name, body, dry)
            return
        self._send(
            405, status(405, "MethodNotAllowed", f"{method} is not allowed here", kind="resourceslices")
        )

    def _create_slice(self, body: Any, dry: bool) -> None:
        state = self.state
        if not isinstance(body, dict):
            self._send(
                400, status(400, "BadRequest", "the body is not a ResourceSlice", kind="resourceslices")
            )
            return
        obj = copy.deepcopy(body)
        meta = obj.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + "".join(
                random.choice("bcdfghjklmnpqrstvwxz2456789") for _ in range(GENERATED_SUFFIX)
            )
        if not state.device_taints:
            drop_taints(obj.get("spec") or {})
        if not state.consumable_capacity:
            drop_consumable_capacity(obj.get("spec") or {})
        if not state.partitionable_devices:
            drop_partitionable(obj.get("spec") or {})
        for key in ("resourceVersion", "uid", "creationTimestamp", "generation"):
            meta.pop(key, None)
        problems = resource_slice_problems(obj, state.kube_version)
        if problems:
            self._invalid("resourceslices", str(meta.get("name", "")), problems)
            return
        with state.lock:
            if meta["name"] in state.resource_slices:
                self._send(409, status(409, "AlreadyExists", f'resourceslices.{RESOURCE_GROUP} "{meta["name"]}" already exists',
                                       meta["name"], "resourceslices"))  # fmt: skip
                return
            meta["uid"] = str(uuid.uuid4())
            meta["creationTimestamp"] = now_rfc3339()
            meta["generation"] = 1
            if not dry:
                state.version += 1
                meta["resourceVersion"] = str(state.version)
                state.resource_slices[meta["name"]] = obj
                state._record("resourceslices", "ADDED", obj)
            self._send(201, copy.deepcopy(obj))

    def _update_slice(self, name: str, body: Any, dry: bool) -> None:
        state = self.state
        if not isinstance(body, dict) or (body.get("metadata") or {}).get("name") != name:
            self._send(400, status(400, "BadRequest", f"the name of the object does not match the name on the URL ({name})",
                                   name, "resourceslices"))  # fmt: skip
            return
        with state.lock:
            current = state.resource_slices.get(name)
            if current is None:
                self._not_found("resourceslices", name)
                return
            sent = body["metadata"].get("resourceVersion")
            if sent and sent != current["metadata"]["resourceVersion"]:
                self._send(409, status(409, "Conflict", f'Operation cannot be fulfilled on resourceslices.{RESOURCE_GROUP} "{name}": '
                                       "the object has been modified; please apply your changes to the latest version and try again",
                                       name, "resourceslices"))  # fmt: skip
                return
            obj = copy.deepcopy(body)
            spec, old = obj.get("spec") or {}, current["spec"]
            if not state.device_taints and not any(d.get("taints") for d in old.get("devices") or []):
                drop_taints(spec)
            if not state.consumable_capacity and not uses_consumable_capacity(old):
                drop_consumable_capacity(spec)
            if not state.partitionable_devices and not uses_partitionable(old):
                drop_partitionable(spec)
            problems = resource_slice_problems(obj, state.kube_version)
            for key in ("driver", "nodeName"):
                if spec.get(key) != old.get(key):
                    problems.append(f"spec.{key}: Invalid value: {spec.get(key)!r}: field is immutable")
            if (spec.get("pool") or {}).get("name") != old["pool"]["name"]:
                problems.append("spec.pool.name: Invalid value: field is immutable")
            if problems:
                self._invalid("resourceslices", name, problems)
                return
            meta = obj["metadata"]
            for key in ("uid", "creationTimestamp"):
                meta[key] = current["metadata"][key]
            meta["generation"] = current["metadata"]["generation"] + (spec != old)
            if not dry:
                state.version += 1
                meta["resourceVersion"] = str(state.version)
                state.resource_slices[name] = obj
                state._record("resourceslices", "MODIFIED", obj)
            else:
                meta["resourceVersion"] = current["metadata"]["resourceVersion"]
            self._send(200, copy.deepcopy(obj))

    def _delete_slices(self, name: str | None, query: dict[str, str], body: Any, dry: bool) -> None:
        state = self.state
        if name is None:  # deletecollection, as the kubelet wipes a node's slices
            if not self._allowed("deletecollection", "resourceslices"):
                return
            terms = self._selector("resourceslices", query)
            if terms is None:
                return
            with state.lock:
                gone = [
                    o if dry else state._delete_slice(n)
                    for n, o in list(state.resource_slices.items())
                    if self._selected(o, terms)
                ]
                version = str(state.version)
            self._send(200, {"kind": "ResourceSliceList", "apiVersion": "resource.k8s.io/v1",
                             "metadata": {"resourceVersion": version}, "items": gone})  # fmt: skip
            return
        if not self._allowed("delete", "resourceslices", name=name):
            return
        pre = (body or {}).get("preconditions") or {} if isinstance(body, dict) else {}
        with state.lock:
            current = state.resource_slices.get(name)
            if current is None:
                self._not_found("resourceslices", name)
                return
            for key in ("uid", "resourceVersion"):
                if pre.get(key) and pre[key] != current["metadata"][key]:
                    self._send(409, status(409, "Conflict", f"Precondition failed: {key} in precondition: {pre[key]}, "
                                           f"{key} in object meta: {current['metadata'][key]}", name, "resourceslices"))  # fmt: skip
                    return
            deleted = copy.deepcopy(current) if dry else state._delete_slice(name)
        self._send(200, copy.deepcopy(deleted))
