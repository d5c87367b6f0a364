"""The fake API server served: `RunningApiServer`, on 127.0.0.1 over TLS, in a thread.

It makes a test CA and a server certificate for 127.0.0.1 signed by it (so a client's kubeconfig
path, CA data and bearer token are all exercised), serves `FakeApiServer` through the handler
(handler.py) on a free port kept across `stop()`/`start()` (an outage and the server back on the
same address), cuts the open connections on demand (`drop_connections()`, a watch ending mid-way as
when a real server restarts), and writes a kubeconfig that trusts it.
"""

from __future__ import annotations

import base64
import contextlib
import datetime
import ipaddress
import socket
import ssl
import sys
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
    live: set[socket.socket]  # RunningApiServer.live: the connections open now

    def shutdown_request(self, request: Any) -> None:
        """Closed (socketserver shuts it down and closes it once its handler is done), then
        forgotten: a connection leaves `live` only when its client can see it closed."""
        try:
            super().shutdown_request(request)
        finally:
            self.live.discard(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that went away mid-answer (a stop, a test cutting connections) is no error."""
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
        httpd.live = self.live
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

    def kubeconfig_for(self, user: str, path: Path) -> Path:
        """A kubeconfig at `path` whose token the server takes as `user` (a node of a fleet)."""
        path.write_text(self.kubeconfig_text(self.ca_data, self.state.add_user(user)))
        return path

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
