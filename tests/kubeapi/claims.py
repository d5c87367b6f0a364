"""resource.k8s.io/v1 ResourceClaims of a namespace, and their status subresource.

get, list, watch, create and delete; and the status PUT: the stored resourceVersion or a 409, only
the status taken (the status strategy resets spec and metadata), status.devices checked as
pkg/apis/resource/validation/validation.go validateResourceClaimStatusUpdate checks it, and dropped
without the DRAResourceClaimDeviceStatus gate (dropDisabledDRAResourceClaimDeviceStatusFields).
"""

from __future__ import annotations

import copy
from typing import Any

from tests.kubeapi.listwatch import ListWatch
from tests.kubeapi.resources import RESOURCE_GROUP, status
from tests.kubeapi.validation import claim_status_problems, resource_claim_problems, schema_problems


class ClaimHandler(ListWatch):
    """resource.k8s.io/v1 ResourceClaims and resourceclaims/status."""

    def _claim(self, method: str, namespace: str, name: str | None, query: dict[str, str], body: Any) -> None:
        """resource.k8s.io/v1 ResourceClaims of a namespace: get, list, watch, create, delete."""
        state = self.state
        if method == "GET" and name is None:
            watching = query.get("watch") in ("true", "1")
            if self._allowed("watch" if watching else "list", "resourceclaims", namespace):

                def current() -> list[dict[str, Any]]:
                    return [o for (ns, _), o in state.resource_claims.items() if ns == namespace]

                if watching:
                    self._watch("resourceclaims", current, query)
                else:
                    with state.lock:
                        objects = current()
                    self._list("resourceclaims", objects, query)
            return
        if method == "GET":
            assert name is not None
            if self._allowed("get", "resourceclaims", namespace, name):
                with state.lock:
                    found = copy.deepcopy(state.resource_claims.get((namespace, name)))
                self._send(200, found) if found else self._not_found("resourceclaims", name)
            return
        if method == "POST" and name is None:
            if not self._allowed("create", "resourceclaims", namespace):
                return
            problems = resource_claim_problems(body, namespace)
            claim_name = str(((body or {}).get("metadata") or {}).get("name", ""))
            if problems:
                self._invalid("resourceclaims", claim_name, problems)
                return
            with state.lock:
                if (namespace, claim_name) in state.resource_claims:
                    self._send(409, status(409, "AlreadyExists", f'resourceclaims.{RESOURCE_GROUP} "{claim_name}" already exists',
                                           claim_name, "resourceclaims"))  # fmt: skip
                    return
                body["metadata"]["namespace"] = namespace
                body["metadata"].pop("uid", None)
                state.put_claim(body, validate=False)
                self._send(201, copy.deepcopy(state.resource_claims[(namespace, claim_name)]))
            return
        if method == "DELETE" and name is not None:
            if not self._allowed("delete", "resourceclaims", namespace, name):
                return
            with state.lock:
                if (namespace, name) not in state.resource_claims:
                    self._not_found("resourceclaims", name)
                    return
                gone = copy.deepcopy(state.resource_claims[(namespace, name)])
                state.delete_claim(namespace, name)
            self._send(200, gone)
            return
        self._send(
            405, status(405, "MethodNotAllowed", f"{method} is not allowed here", kind="resourceclaims")
        )

    def _claim_status(self, method: str, namespace: str, name: str, body: Any) -> None:
        """PUT of a ResourceClaim's status subresource: the resourceVersion must be the stored one
        (409 otherwise); only the status is taken (the status strategy resets spec and metadata);
        status.devices is checked as validateResourceClaimStatusUpdate checks it; without the
        DRAResourceClaimDeviceStatus gate it is dropped (dropDisabledDRAResourceClaimDeviceStatusFields)."""
        state = self.state
        if method == "GET":
            if self._allowed("get", "resourceclaims/status", namespace, name):
                with state.lock:
                    found = copy.deepcopy(state.resource_claims.get((namespace, name)))
                self._send(200, found) if found else self._not_found("resourceclaims", name)
            return
        if method != "PUT":
            self._send(
                405, status(405, "MethodNotAllowed", f"{method} is not allowed here", kind="resourceclaims")
            )
            return
        if not self._allowed("update", "resourceclaims/status", namespace, name):
            return
        with state.lock:
            current = state.resource_claims.get((namespace, name))
            if current is None:
                self._not_found("resourceclaims", name)
                return
            sent = ((body or {}).get("metadata") or {}).get("resourceVersion")
            if sent != current["metadata"]["resourceVersion"]:
                self._send(409, status(409, "Conflict", f'Operation cannot be fulfilled on resourceclaims.{RESOURCE_GROUP} "{name}": '
                                       "the object has been modified; please apply your changes to the latest version and try again",
                                       name, "resourceclaims"))  # fmt: skip
                return
            updated = copy.deepcopy(current)
            new_status = copy.deepcopy((body or {}).get("status") or {})
            if not state.claim_device_status:
                new_status.pop("devices", None)
            updated["status"] = new_status
            problems = schema_problems(updated) + claim_status_problems(updated)
            if problems:
                state.errors.extend(problems)
                self._invalid("resourceclaims", name, problems)
                return
            state.version += 1
            updated["metadata"]["resourceVersion"] = str(state.version)
            state.resource_claims[(namespace, name)] = updated
            state._record("resourceclaims", "MODIFIED", updated)
            self._send(200, copy.deepcopy(updated))
