"""A fake Kubernetes API server for tests: the real one's contract where gpuvisor depends on it.

No API server can run here (MACHINE-NOTES.md), so this serves the REST paths gpuvisor uses, over
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
  counts, semver, taints); `device_taints=False` is a server without the DRADeviceTaints gate,
  which drops `devices[].taints` on write; `dra=False` one that does not serve the API at all;
- RBAC: with `allow` set, a request whose (verb, resource) is not in it gets the real 403 text;
- NFD's NodeFeature (checked against NFD v0.19.0's CRD schema, `tests/data/`, as the structural
  schema it is, so unknown fields fail too) and pods (read only);
- every request is recorded with its user agent and field manager (the `fieldManager` parameter,
  else the user agent up to its first "/", as the real server derives it).

And the failures a real server shows: a frozen server (`freeze()`: requests hang until `thaw()`),
dropped watch connections (`drop_connections()`), an outage (`stop()` then `start()` on the same
port), and one injected failure per method (`fail_next`). Refusals of what gpuvisor sent are
recorded in `errors`, which a test expects empty.
"""

from __future__ import annotations

import base64
import contextlib
import datetime
import ipaddress
import socket
import ssl
import threading
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from tests.kubeapi.handler import ApiHandler
from tests.kubeapi.resources import TOKEN
from tests.kubeapi.state import FakeApiServer
from tests.kubeapi.validation import condition_list_problems, node_feature_problems

__all__ = [  # what tests import from here
    "TOKEN",
    "FakeApiServer",
    "RunningApiServer",
    "condition_list_problems",
    "node_feature_problems",
]


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


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that went away mid-answer (a stop, a test cutting connections) is no error."""
        import sys

        if not isinstance(sys.exc_info()[1], OSError):
            super().handle_error(request, client_address)


class RunningApiServer:
    """The fake on 127.0.0.1 (a free port, kept across stop()/start()) in a thread, and a kubeconfig
    that trusts it."""

    def __init__(self, directory: Path, state: FakeApiServer | None = None) -> None:
        self.state = state or FakeApiServer()
        ca_pem, self._cert_file, self._key_file = _certificates(directory)
        self.live: set[socket.socket] = set()
        self.port = 0
        self.httpd: _Server | None = None
        self.thread: threading.Thread | None = None
        self.start()
        self.url = f"https://127.0.0.1:{self.port}"
        self.ca_data = base64.b64encode(ca_pem).decode()
        self.kubeconfig = directory / "kubeconfig"
        self.kubeconfig.write_text(self.kubeconfig_text(self.ca_data))

    def start(self) -> None:
        """Serve (again, on the same port after stop())."""
        handler = type("Handler", (ApiHandler,), {"state": self.state, "live": self.live})
        httpd = _Server(("127.0.0.1", self.port), handler)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(self._cert_file, self._key_file)
        httpd.socket = context.wrap_socket(httpd.socket, server_side=True)
        self.port = httpd.server_address[1]
        self.httpd = httpd
        self.thread = threading.Thread(
            target=httpd.serve_forever, args=(0.05,), name="fake-apiserver", daemon=True
        )
        self.thread.start()

    def stop(self) -> None:
        """An outage: no more connections are accepted and the open ones (watches) are cut."""
        if self.httpd is not None:
            self.httpd.shutdown()
            self.httpd.server_close()
            self.httpd = None
        if self.thread is not None:
            self.thread.join(timeout=10)
            self.thread = None
        self.drop_connections()

    def drop_connections(self) -> None:
        """Cut every connection being served (a watch stream ends mid-way, as when a server restarts)."""
        for conn in list(self.live):
            with contextlib.suppress(OSError):
                socket.socket.shutdown(conn, socket.SHUT_RDWR)

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
        self.state.thaw()
        self.stop()
