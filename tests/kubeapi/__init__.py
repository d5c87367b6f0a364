"""A fake Kubernetes API server for tests: the real one's contract where gpuvisor depends on it.

No API server can be installed where the suite runs (docs/testing.md), so this serves the REST paths gpuvisor uses, over
TLS with a certificate from its own test CA and a bearer token (so the client's kubeconfig path,
CA data and token, is exercised), with the real server's rules for them:

- Status objects for refusals (401, 403, 404, 405, 409, 410, 415, 422), and, as the real server's
  mux does, a plain-text `404 page not found` for a path it does not serve at all: an unknown
  path, or a CRD's path while the CRD is not installed (`crds`);
- `resourceVersion`: one counter for every write; optimistic concurrency (a stale version sent
  back is 409 Conflict); list answers carry the collection's version;
- watch (`?watch=true`) of nodes: chunked JSON lines from a resourceVersion (or the current state
  as ADDED events without one), `fieldSelector=metadata.name=...`, BOOKMARK events when asked
  (`allowWatchBookmarks`, every `bookmark_s`), `timeoutSeconds`, and `410 Gone` for a version
  older than the last compaction (`compact()`): as an HTTP 410 when the watch starts, as an ERROR
  event in a stream that `expire_watches()` ends;
- the `status` subresource of nodes, PATCHed with a strategic-merge patch that merges
  `status.conditions` by `type` (other conditions untouched) or with a JSON merge patch;
- core/v1 Events: created (validated: namespace rules for a cluster-scoped object, type, name,
  timestamps), PATCHed (count, lastTimestamp), listed;
- resource.k8s.io/v1 ResourceSlices (cluster-scoped: get, list and watch by `fieldSelector`
  `spec.nodeName` / `spec.driver` / `metadata.name` as the real server indexes them, any other
  field a 400; create with `generateName`, update with optimistic concurrency and the immutable
  driver, pool name and node name, delete with `preconditions`, deletecollection as the kubelet
  wipes a node's slices, `dryRun=All`) and ResourceClaims (get, list, watch, create, delete),
  each checked against the `resource.k8s.io/v1` schema (kubernetes-validate's, strict) and the
  server's own rules (one controller owner, one of nodeName/nodeSelector/allNodes, device names,
  counts, semver, taints, consumable capacity's request policies: `capacity.py`); `device_taints=False`
  is a server without the DRADeviceTaints gate, which drops `devices[].taints` on write;
  `consumable_capacity` (off by default, as in 1.34 and 1.35) the DRAConsumableCapacity gate, without
  which `allowMultipleAllocations` and `requestPolicy` are dropped; `partitionable_devices` (off by
  default, as in 1.33 to 1.35) the DRAPartitionableDevices gate, without which `sharedCounters` and
  `consumesCounters` are dropped, with them checked by the served version's rules (`partitions.py`:
  1.34's counter sets in the devices' own slice, 1.35's in a slice of their own); `kube_version`
  the served version (the schema's, the rules', and `GET /version`'s answer, `version_info()`);
  `dra=False` one that does not serve the API at all;
- RBAC: with `allow` set, a request whose (verb, resource) is not in it gets the real 403 text;
- NFD's NodeFeature (checked against NFD v0.19.0's CRD schema, `tests/data/`, as the structural
  schema it is, so unknown fields fail too) and pods (read only);
- every request is recorded with its user agent and field manager (the `fieldManager` parameter,
  else the user agent up to its first "/", as the real server derives it) and the user its bearer
  token names (`add_user`, `RunningApiServer.kubeconfig_for`: one token per node of a fleet), and
  counted by verb, resource and user, with the watches open now (`tally`).

And the failures a real server shows: a frozen server (`freeze()`: requests hang until `thaw()`),
dropped watch connections (`drop_connections()`), an outage (`stop()` then `start()` on the same
port), and one injected failure per method (`fail_next`). Refusals of what gpuvisor sent are
recorded in `errors`, which a test expects empty.

Where each part lives: `state.py` (FakeApiServer: the objects, the watch history, the helpers tests
call), `validation.py` (what the server refuses in an object; `capacity.py` its consumable-capacity rules,
`partitions.py` its partitionable-devices rules), `patch.py` (strategic merge, JSON
merge and JSON patch), `resources.py` (groups, kinds, the token, the Status of an error),
`handler.py` (the checks every request passes and the dispatch by path) over one part per resource
(`nodes.py`, `events.py`, `slices.py`, `claims.py`, `nodefeatures.py`), `listwatch.py` (field
selectors, lists, watches), `base.py` (answers, RBAC), `tally.py` (the counts), and `server.py`
(RunningApiServer, its certificates, the kubeconfig). The names tests use are imported here.
"""

from __future__ import annotations

from tests.kubeapi.patch import JsonPatchError, json_patch, merge_patch, strategic_merge
from tests.kubeapi.resources import TOKEN, USER, status
from tests.kubeapi.server import RunningApiServer
from tests.kubeapi.state import FakeApiServer, Request
from tests.kubeapi.validation import (
    claim_status_problems,
    condition_list_problems,
    condition_problems,
    event_problems,
    node_feature_problems,
    resource_claim_problems,
    resource_slice_problems,
    schema_problems,
)

__all__ = [
    "TOKEN",
    "USER",
    "FakeApiServer",
    "JsonPatchError",
    "Request",
    "RunningApiServer",
    "claim_status_problems",
    "condition_list_problems",
    "condition_problems",
    "event_problems",
    "json_patch",
    "merge_patch",
    "node_feature_problems",
    "resource_claim_problems",
    "resource_slice_problems",
    "schema_problems",
    "status",
    "strategic_merge",
]
