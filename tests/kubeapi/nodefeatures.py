"""NFD's NodeFeature (nfd.k8s-sigs.io/v1alpha1): get, create and update.

A CRD's resource: served while its group is in `crds` (else the mux's plain 404, see handler.py);
each object checked against NFD v0.19.0's CRD schema (validation.node_feature_problems); an update
needs the stored resourceVersion (409 otherwise).
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from tests.kubeapi.base import HandlerBase
from tests.kubeapi.resources import status
from tests.kubeapi.state import now_rfc3339
from tests.kubeapi.validation import node_feature_problems


class NodeFeatureHandler(HandlerBase):
    """NFD's NodeFeatures."""

    def _node_feature(self, method: str, namespace: str, name: str | None, body: Any) -> None:
        state = self.state
        key = (namespace, name or "")
        if method == "GET" and name:
            if not self._allowed("get", "nodefeatures", namespace, name):
                return
            found = state.node_features.get(key)
            if found is None:
                self._send(
                    404, status(404, "NotFound", f'nodefeatures.nfd.k8s-sigs.io "{name}" not found', name)
                )
            else:
                self._send(200, found)
            return
        if method not in ("POST", "PUT") or (method == "POST") == bool(name):
            self._send(405, status(405, "MethodNotAllowed", f"{method} is not allowed here"))
            return
        if not self._allowed(
            "create" if method == "POST" else "update", "nodefeatures", namespace, name or ""
        ):
            return
        problems = node_feature_problems(body, namespace, name)
        if problems:
            state.errors.extend(problems)
            self._send(422, status(422, "Invalid", "; ".join(problems)))
            return
        obj_name = body["metadata"]["name"]
        with state.lock:
            current = state.node_features.get((namespace, obj_name))
            if method == "POST" and current is not None:
                self._send(
                    409,
                    status(
                        409,
                        "AlreadyExists",
                        f'nodefeatures.nfd.k8s-sigs.io "{obj_name}" already exists',
                        obj_name,
                    ),
                )
                return
            if method == "PUT":
                if current is None:
                    self._send(
                        404,
                        status(
                            404, "NotFound", f'nodefeatures.nfd.k8s-sigs.io "{obj_name}" not found', obj_name
                        ),
                    )
                    return
                sent = body["metadata"].get("resourceVersion")
                if sent != current["metadata"]["resourceVersion"]:
                    self._send(
                        409,
                        status(
                            409,
                            "Conflict",
                            f"Operation cannot be fulfilled: the object has been modified (resourceVersion {sent!r})",
                            obj_name,
                        ),
                    )
                    return
            state.version += 1
            stored = json.loads(json.dumps(body))
            meta = stored["metadata"]
            meta["namespace"] = namespace
            meta["resourceVersion"] = str(state.version)
            meta.setdefault("uid", current["metadata"]["uid"] if current else str(uuid.uuid4()))
            meta.setdefault("creationTimestamp", now_rfc3339())
            meta["generation"] = (current["metadata"].get("generation", 1) + 1) if current else 1
            state.node_features[(namespace, obj_name)] = stored
        self._send(201 if method == "POST" else 200, stored)
