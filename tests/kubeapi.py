"""A local HTTPS endpoint that answers as the Kubernetes API server's REST paths do, for NodeFeature tests.

No API server can run here (MACHINE-NOTES.md), so this serves the few documented paths the
labeller uses, with the API server's rules for them (the API conventions' Status objects,
`resourceVersion` optimistic concurrency, 201 on create, 404/409 reasons):

- `GET /api/v1/namespaces/{ns}/pods/{name}`
- `GET|PUT /apis/nfd.k8s-sigs.io/v1alpha1/namespaces/{ns}/nodefeatures/{name}`
- `POST /apis/nfd.k8s-sigs.io/v1alpha1/namespaces/{ns}/nodefeatures`

It speaks TLS with a certificate from its own test CA and wants a bearer token, as a real
server does, so the client's kubeconfig path (CA data, token) is exercised. Every NodeFeature
sent is checked against NFD's NodeFeature CRD schema (`tests/data/nfd-nodefeature-v1alpha1-schema.yaml`,
transcribed from NFD v0.19.0) as a structural schema: unknown fields, which the API server would
prune, are errors too, and so is metadata the API server would refuse. A request that breaks a
rule is answered as the API server would (422 Invalid) and recorded in `errors`.
"""

from __future__ import annotations

import base64
import datetime
import ipaddress
import json
import re
import ssl
import threading
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import jsonschema
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

SCHEMA_FILE = Path(__file__).parent / "data" / "nfd-nodefeature-v1alpha1-schema.yaml"
NF_PATH = re.compile(r"^/apis/nfd\.k8s-sigs\.io/v1alpha1/namespaces/([^/]+)/nodefeatures(?:/([^/]+))?$")
POD_PATH = re.compile(r"^/api/v1/namespaces/([^/]+)/pods/([^/]+)$")
DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
LABEL_NAME = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?$")
TOKEN = "gpuvisor-test-token"


def structural(schema: Any) -> Any:
    """The CRD's openAPIV3Schema as a JSON schema that also refuses fields the server would prune."""
    if isinstance(schema, dict):
        out = {k: structural(v) for k, v in schema.items()}
        if out.get("type") == "object" and "properties" in out and "additionalProperties" not in out:
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [structural(v) for v in schema]
    return schema


NODE_FEATURE_SCHEMA = structural(yaml.safe_load(SCHEMA_FILE.read_text()))


def node_feature_problems(obj: Any, namespace: str, name: str | None) -> list[str]:
    """What the API server would refuse in a NodeFeature sent to `namespace` (and `name` for a PUT)."""
    problems = [
        f"{'.'.join(map(str, e.absolute_path)) or '(object)'}: {e.message}"
        for e in jsonschema.Draft7Validator(NODE_FEATURE_SCHEMA).iter_errors(obj)
    ]
    if not isinstance(obj, dict):
        return problems or ["not an object"]
    if (obj.get("apiVersion"), obj.get("kind")) != ("nfd.k8s-sigs.io/v1alpha1", "NodeFeature"):
        problems.append(
            f"apiVersion/kind {obj.get('apiVersion')}/{obj.get('kind')} is not nfd.k8s-sigs.io/v1alpha1/NodeFeature"
        )
    meta = obj.get("metadata") or {}
    obj_name = meta.get("name", "")
    if not isinstance(obj_name, str) or len(obj_name) > 253 or not DNS_SUBDOMAIN.match(obj_name):
        problems.append(f"metadata.name {obj_name!r} is not a DNS-1123 subdomain")
    if name is not None and obj_name != name:
        problems.append(f"metadata.name {obj_name!r} does not match the URL's {name!r}")
    if meta.get("namespace", namespace) != namespace:
        problems.append(
            f"metadata.namespace {meta.get('namespace')!r} does not match the URL's {namespace!r}"
        )
    for key, value in (meta.get("labels") or {}).items():
        prefix, _, label = key.rpartition("/")
        if not (LABEL_NAME.match(label) and 0 < len(label) <= 63) or (
            prefix and not DNS_SUBDOMAIN.match(prefix)
        ):
            problems.append(f"metadata.labels key {key!r} is not a valid label name")
        if not isinstance(value, str) or len(value) > 63 or not LABEL_NAME.match(value):
            problems.append(f"metadata.labels[{key!r}] value {value!r} is not a valid label value")
    for i, ref in enumerate(meta.get("ownerReferences") or []):
        missing = [k for k in ("apiVersion", "kind", "name", "uid") if not ref.get(k)]
        if missing:
            problems.append(f"metadata.ownerReferences[{i}]: missing {missing}")
    if sum(1 for ref in meta.get("ownerReferences") or [] if ref.get("controller")) > 1:
        problems.append("metadata.ownerReferences: only one reference can have controller set to true")
    return problems


@dataclass
class Request:
    method: str
    path: str
    body: Any
    content_type: str | None = None


@dataclass
class FakeApiServer:
    """The endpoint's state: stored objects, pods, every request, every refusal, injected failures."""

    node_features: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    pods: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    requests: list[Request] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    fail_next: dict[str, tuple[int, str]] = field(default_factory=dict)  # method -> (code, reason)
    lock: threading.Lock = field(default_factory=threading.Lock)
    version: int = 0

    def add_daemonset_pod(self, namespace: str, name: str) -> dict[str, Any]:
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": name,
                "namespace": namespace,
                "uid": str(uuid.uuid4()),
                "ownerReferences": [
                    {"apiVersion": "apps/v1", "kind": "DaemonSet", "name": "gpuvisor-labels", "uid": str(uuid.uuid4()),
                     "controller": True, "blockOwnerDeletion": True},
                ],
            },
            "spec": {"containers": [{"name": "labels", "image": "gpuvisor"}]},
        }  # fmt: skip
        self.pods[(namespace, name)] = pod
        return pod

    def calls(self, method: str | None = None) -> list[Request]:
        with self.lock:
            return [r for r in self.requests if method is None or r.method == method]


def status(
    code: int, reason: str, message: str, name: str = "", kind: str = "nodefeatures"
) -> dict[str, Any]:
    """A metav1.Status as the API server sends it with an error."""
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "details": {"name": name, "group": "nfd.k8s-sigs.io" if kind == "nodefeatures" else "", "kind": kind},
        "code": code,
    }


class _Handler(BaseHTTPRequestHandler):
    server_version = "fake-kube-apiserver"
    state: FakeApiServer  # set on the subclass made per server

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _send(self, code: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _handle(self, method: str) -> None:
        state = self.state
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        body = json.loads(raw) if raw else None
        path = self.path.split("?", 1)[0]
        with state.lock:
            state.requests.append(Request(method, path, body, self.headers.get("Content-Type")))
            if self.headers.get("Authorization") != f"Bearer {TOKEN}":
                self._send(401, status(401, "Unauthorized", "Unauthorized"))
                return
            if method in state.fail_next:
                code, reason = state.fail_next.pop(method)
                self._send(code, status(code, reason, f"injected {reason}"))
                return
            # The API server takes a missing Content-Type as its first media type, JSON.
            if (
                method in ("POST", "PUT")
                and self.headers.get("Content-Type", "application/json").split(";")[0] != "application/json"
            ):
                self._send(415, status(415, "UnsupportedMediaType", "expected application/json"))
                return
            pod = POD_PATH.match(path)
            if pod and method == "GET":
                found = state.pods.get((pod[1], pod[2]))
                if found is None:
                    self._send(404, status(404, "NotFound", f'pods "{pod[2]}" not found', pod[2], "pods"))
                else:
                    self._send(200, found)
                return
            nf = NF_PATH.match(path)
            if nf is None:
                self._send(404, status(404, "NotFound", "the server could not find the requested resource"))
                return
            self._node_feature(method, nf[1], nf[2], body)

    def _node_feature(self, method: str, namespace: str, name: str | None, body: Any) -> None:
        state = self.state
        key = (namespace, name or "")
        if method == "GET" and name:
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
        problems = node_feature_problems(body, namespace, name)
        if problems:
            state.errors.extend(problems)
            self._send(422, status(422, "Invalid", "; ".join(problems)))
            return
        obj_name = body["metadata"]["name"]
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
                    status(404, "NotFound", f'nodefeatures.nfd.k8s-sigs.io "{obj_name}" not found', obj_name),
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
        meta.setdefault(
            "creationTimestamp", datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        )
        meta["generation"] = (current["metadata"].get("generation", 1) + 1) if current else 1
        state.node_features[(namespace, obj_name)] = stored
        self._send(201 if method == "POST" else 200, stored)

    def do_GET(self) -> None:
        self._handle("GET")

    def do_POST(self) -> None:
        self._handle("POST")

    def do_PUT(self) -> None:
        self._handle("PUT")


def _certificates(directory: Path) -> tuple[bytes, Path, Path]:
    """A test CA (PEM bytes) and a server certificate and key for 127.0.0.1 signed by it (files)."""
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "gpuvisor test CA")])
    ca = (
        x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=2))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )  # fmt: skip
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
        .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(hours=2))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )  # fmt: skip
    cert_file, key_file = directory / "server.crt", directory / "server.key"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return ca.public_bytes(serialization.Encoding.PEM), cert_file, key_file


class RunningApiServer:
    """The endpoint on 127.0.0.1 (a free port) in a thread, and a kubeconfig that trusts it."""

    def __init__(self, directory: Path) -> None:
        self.state = FakeApiServer()
        ca_pem, cert_file, key_file = _certificates(directory)
        handler = type("Handler", (_Handler,), {"state": self.state})
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(cert_file, key_file)
        self.httpd.socket = context.wrap_socket(self.httpd.socket, server_side=True)
        self.url = f"https://127.0.0.1:{self.httpd.server_address[1]}"
        self.ca_data = base64.b64encode(ca_pem).decode()
        self.kubeconfig = directory / "kubeconfig"
        self.kubeconfig.write_text(self.kubeconfig_text(self.ca_data))
        self.thread = threading.Thread(
            target=self.httpd.serve_forever, args=(0.05,), name="fake-apiserver", daemon=True
        )
        self.thread.start()

    def kubeconfig_text(self, ca_data: str, token: str = TOKEN) -> str:
        return yaml.safe_dump({
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "test", "cluster": {"server": self.url, "certificate-authority-data": ca_data}}],
            "users": [{"name": "labeller", "user": {"token": token}}],
            "contexts": [{"name": "test", "context": {"cluster": "test", "user": "labeller"}}],
            "current-context": "test",
        })  # fmt: skip

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=10)
