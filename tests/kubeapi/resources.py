"""The resources the fake API server serves and the words its answers use.

The API groups and kinds, the fields each resource can be selected by (the real server's field
label conversions: any other field is a 400), the bearer token it accepts and the user its RBAC
refusals name, and the metav1.Status an error is answered with.
"""

from __future__ import annotations

from typing import Any

TOKEN = "gpuvisor-test-token"
USER = "system:serviceaccount:gpuvisor:gpuvisor"
NFD_GROUP = "nfd.k8s-sigs.io"
RESOURCE_GROUP = "resource.k8s.io"
GROUPS = {"nodefeatures": NFD_GROUP, "resourceslices": RESOURCE_GROUP, "resourceclaims": RESOURCE_GROUP}
KINDS = {
    "nodes": ("v1", "Node"),
    "resourceslices": ("resource.k8s.io/v1", "ResourceSlice"),
    "resourceclaims": ("resource.k8s.io/v1", "ResourceClaim"),
}
# The fields each resource can be selected by (the real server's field label conversions): a list
# or watch with any other field is a 400.
FIELD_LABELS = {
    "nodes": ("metadata.name",),
    "resourceslices": ("metadata.name", "spec.nodeName", "spec.driver"),
    "resourceclaims": ("metadata.name", "metadata.namespace"),
}


def status(
    code: int, reason: str, message: str, name: str = "", kind: str = "nodefeatures", group: str | None = None
) -> dict[str, Any]:
    """A metav1.Status as the API server sends it with an error."""
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "details": {"name": name, "group": GROUPS.get(kind, "") if group is None else group, "kind": kind},
        "code": code,
    }  # fmt: skip
