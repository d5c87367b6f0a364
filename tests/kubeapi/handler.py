"""The fake API server's HTTP handler: the checks every request passes, then its resource's part.

Each request is recorded (user agent, and field manager: the `fieldManager` parameter, else the
user agent up to its first "/", as the real server derives it; the user its token names) and
counted (`state.tally`, tally.py); a frozen server (`freeze()`) hangs it; then, as the real
server's filters do before a resource sees it: a bearer token the server does not know is 401,
a throttled one (`throttle()`) priority and fairness's 429 with `Retry-After`, an injected
failure (`fail_next`) answers, a POST or PUT that is not JSON is 415 and a body that is
not an object 400. The path picks the part (one class per resource in this package, joined here):
`GET /version` (the served version's k8s.io/apimachinery version.Info, to anyone, the anonymous
user too), pods (read only), nodes, events, ResourceSlices and ResourceClaims (while `dra`), NodeFeatures
(while the CRD is installed); any other path gets the mux's plain `404 page not found`.
"""

from __future__ import annotations

import json
import re
import urllib.parse

from tests.kubeapi.claims import ClaimHandler
from tests.kubeapi.events import EventHandler
from tests.kubeapi.nodefeatures import NodeFeatureHandler
from tests.kubeapi.nodes import NodeHandler
from tests.kubeapi.patch import JSON_PATCH
from tests.kubeapi.resources import NFD_GROUP, status
from tests.kubeapi.slices import SliceHandler
from tests.kubeapi.state import Request

VERSION_PATH = "/version"
NF_PATH = re.compile(r"^/apis/nfd\.k8s-sigs\.io/v1alpha1/namespaces/([^/]+)/nodefeatures(?:/([^/]+))?$")
POD_PATH = re.compile(r"^/api/v1/namespaces/([^/]+)/pods/([^/]+)$")
NODE_PATH = re.compile(r"^/api/v1/nodes(?:/([^/]+)(?:/(status))?)?$")
EVENT_PATH = re.compile(r"^/api/v1/namespaces/([^/]+)/events(?:/([^/]+))?$")
SLICE_PATH = re.compile(r"^/apis/resource\.k8s\.io/v1/resourceslices(?:/([^/]+))?$")
CLAIM_PATH = re.compile(
    r"^/apis/resource\.k8s\.io/v1/namespaces/([^/]+)/resourceclaims(?:/([^/]+)(?:/(status))?)?$"
)


class ApiHandler(NodeHandler, EventHandler, SliceHandler, ClaimHandler, NodeFeatureHandler):
    """One request: the checks every request passes, then the part that serves its path."""

    def _handle(self, method: str) -> None:
        state = self.state
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        split = urllib.parse.urlsplit(self.path)
        path = split.path
        query = dict(urllib.parse.parse_qsl(split.query, keep_blank_values=True))
        ua = self.headers.get("User-Agent", "")
        manager = query.get("fieldManager") or ua.split("/", 1)[0]
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = raw.decode(errors="replace")
        auth = self.headers.get("Authorization", "")
        self.user = state.users.get(auth.removeprefix("Bearer "), "") if auth.startswith("Bearer ") else ""
        with state.lock:
            state.requests.append(
                Request(method, path, body, self.headers.get("Content-Type"), query, ua, manager, self.user)
            )
        state.tally.count(method, path, query, self.user)
        while state.frozen.is_set():  # a hung server: the request waits, unanswered
            state.thawed.wait(0.2)
        # /version is served to anyone, the anonymous user too (the system:public-info-viewer
        # ClusterRole binds it to system:authenticated and system:unauthenticated); a bearer
        # token the server does not know still fails authentication first.
        if not self.user and not (path == VERSION_PATH and not auth):
            self._send(401, status(401, "Unauthorized", "Unauthorized"))
            return
        with state.lock:
            key = method if method in state.throttled else "*"
            if key in state.throttled:
                left, retry_after = state.throttled.pop(key)
                if left > 1:
                    state.throttled[key] = (left - 1, retry_after)
                self._too_many(retry_after)
                return
            if method in state.fail_next:
                code, reason = state.fail_next.pop(method)
                self._send(code, status(code, reason, f"injected {reason}"))
                return
        if (
            method in ("POST", "PUT")
            and (self.headers.get("Content-Type") or "application/json").split(";")[0] != "application/json"
        ):
            self._send(415, status(415, "UnsupportedMediaType", "expected application/json"))
            return
        json_patch_body = method == "PATCH" and (self.headers.get("Content-Type") or "").startswith(
            JSON_PATCH
        )
        if not isinstance(body, dict | None) and not (json_patch_body and isinstance(body, list)):
            self._send(400, status(400, "BadRequest", "the body is not a JSON object"))
            return
        if path == VERSION_PATH and method == "GET":
            self._send(200, state.version_info())
            return
        if (m := POD_PATH.match(path)) and method == "GET":
            if self._allowed("get", "pods", m[1], m[2]):
                found = state.pods.get((m[1], m[2]))
                if found is None:
                    self._send(404, status(404, "NotFound", f'pods "{m[2]}" not found', m[2], "pods"))
                else:
                    self._send(200, found)
            return
        if (m := NODE_PATH.match(path)) is not None:
            self._node(method, m[1], m[2], query, body)
            return
        if (m := EVENT_PATH.match(path)) is not None:
            self._event(method, m[1], m[2], body)
            return
        if (m := SLICE_PATH.match(path)) is not None and state.dra:
            self._slice(method, m[1], query, body)
            return
        if (m := CLAIM_PATH.match(path)) is not None and state.dra:
            if m[3]:
                self._claim_status(method, m[1], m[2], body)
            else:
                self._claim(method, m[1], m[2], query, body)
            return
        nf = NF_PATH.match(path)
        if nf is None or NFD_GROUP not in state.crds:
            self._plain_404()
            return
        self._node_feature(method, nf[1], nf[2], body)

    def do_GET(self) -> None:
        self._handle("GET")

    def do_POST(self) -> None:
        self._handle("POST")

    def do_PUT(self) -> None:
        self._handle("PUT")

    def do_PATCH(self) -> None:
        self._handle("PATCH")

    def do_DELETE(self) -> None:
        self._handle("DELETE")
