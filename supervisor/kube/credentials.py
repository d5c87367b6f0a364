"""Where the API server is and who gpuvisor is to it: a kubeconfig, or the pod's service account.

The rules are client-go's (`clientcmd.BuildConfigFromFlags` with the one path given, and
`rest.InClusterConfig` when it is empty), for what a node agent uses:

- a kubeconfig's current context names a cluster (`server`, `certificate-authority[-data]`,
  `insecure-skip-tls-verify`, `tls-server-name`) and a user (`token`, `tokenFile`,
  `client-certificate[-data]` with `client-key[-data]`, `username`/`password`, or an `exec`
  credential plugin that prints an ExecCredential token); relative paths are relative to the
  kubeconfig's directory;
- in a pod, KUBERNETES_SERVICE_HOST/PORT and the service account's token and CA under
  /var/run/secrets/kubernetes.io/serviceaccount. The token is read again every minute, as
  client-go does: a projected token is rotated while the pod runs.

What a node agent never needs is refused with a clear error rather than half-supported: the
removed `auth-provider` plugins, an exec plugin's client certificates, and proxies.
Everything read is bounded (the kubeconfig and each file in it).
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import ssl
import subprocess
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import yaml

from supervisor.kube.errors import CredentialsError

SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
MAX_FILE_BYTES = 1024 * 1024
TOKEN_REREAD_S = 60.0  # client-go's cachingTokenSource period for file tokens
EXEC_TIMEOUT_S = 30.0


def _read(path: str, what: str, *, text: bool = True) -> Any:
    try:
        with open(path, "rb") as fh:
            data = fh.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise CredentialsError(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    if len(data) > MAX_FILE_BYTES:
        raise CredentialsError(f"{what} {path} is over {MAX_FILE_BYTES} bytes")
    return data.decode("utf-8", errors="replace") if text else data


class TokenSource:
    """A bearer token: `token()` is the current one, `invalidate()` after a 401 drops a cached one."""

    def token(self) -> str:
        raise NotImplementedError

    def invalidate(self) -> None:
        pass


class StaticToken(TokenSource):
    def __init__(self, value: str) -> None:
        self.value = value

    def token(self) -> str:
        return self.value


class FileToken(TokenSource):
    """A token file read again once a minute (a projected service-account token rotates)."""

    def __init__(self, path: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.path = path
        self._clock = clock
        self._value = ""
        self._read_at: float | None = None
        self._lock = threading.Lock()

    def token(self) -> str:
        with self._lock:
            now = self._clock()
            if self._read_at is None or now - self._read_at >= TOKEN_REREAD_S:
                self._value = str(_read(self.path, "token file")).strip()
                self._read_at = now
            return self._value

    def invalidate(self) -> None:
        with self._lock:
            self._read_at = None


class ExecToken(TokenSource):
    """client-go's exec credential plugin (client.authentication.k8s.io v1 or v1beta1), tokens only:
    the command's ExecCredential is kept until its expirationTimestamp or a 401."""

    def __init__(self, spec: Mapping[str, Any], base_dir: str, environ: Mapping[str, str]) -> None:
        command = spec.get("command")
        if not isinstance(command, str) or not command:
            raise CredentialsError("user.exec.command must be a non-empty string")
        if "/" in command and not os.path.isabs(command):
            command = os.path.join(base_dir, command)  # client-go: relative to the kubeconfig
        args = spec.get("args") or []
        env = spec.get("env") or []
        if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
            raise CredentialsError("user.exec.args must be a list of strings")
        if not isinstance(env, list) or not all(
            isinstance(e, dict) and isinstance(e.get("name"), str) and isinstance(e.get("value"), str)
            for e in env
        ):
            raise CredentialsError("user.exec.env must be a list of {name, value} strings")
        self.api_version = str(spec.get("apiVersion") or "client.authentication.k8s.io/v1")
        self.argv = [command, *args]
        self.environ = {**environ, **{e["name"]: e["value"] for e in env}}
        self.environ["KUBERNETES_EXEC_INFO"] = json.dumps(
            {"apiVersion": self.api_version, "kind": "ExecCredential", "spec": {"interactive": False}}
        )
        self._value = ""
        self._expires: float | None = None
        self._lock = threading.Lock()

    def token(self) -> str:
        with self._lock:
            if self._value and (self._expires is None or time.time() < self._expires - 10):
                return self._value
            self._value, self._expires = self._run()
            return self._value

    def invalidate(self) -> None:
        with self._lock:
            self._value = ""

    def _run(self) -> tuple[str, float | None]:
        what = f"exec credential plugin {self.argv[0]}"
        try:
            done = subprocess.run(
                self.argv,
                env=self.environ,
                capture_output=True,
                timeout=EXEC_TIMEOUT_S,
                stdin=subprocess.DEVNULL,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise CredentialsError(f"{what} could not run: {exc}") from None
        if done.returncode != 0:
            tail = done.stderr.decode(errors="replace").strip()[-300:]
            raise CredentialsError(f"{what} exited with status {done.returncode}: {tail}")
        try:
            cred = json.loads(done.stdout[:MAX_FILE_BYTES])
            status = cred["status"]
        except (ValueError, KeyError, TypeError):
            raise CredentialsError(f"{what} did not print an ExecCredential with a status") from None
        token = status.get("token") if isinstance(status, dict) else None
        if not isinstance(token, str) or not token:
            raise CredentialsError(
                f"{what}: only token credentials are supported (it gave no status.token; "
                "client certificates from a plugin are not)"
            )
        expires = status.get("expirationTimestamp")
        when = None
        if isinstance(expires, str) and expires:
            when = _parse_time(expires)
        return token, when


def _parse_time(text: str) -> float | None:
    import datetime

    try:
        return datetime.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


@dataclass(frozen=True)
class Credentials:
    """Everything needed to open an authenticated connection to the API server."""

    scheme: str  # "https" or "http"
    host: str
    port: int
    base_path: str  # the server URL's path, "" for most clusters
    ssl_context: ssl.SSLContext | None
    server_hostname: str | None  # TLS name to check (tls-server-name), else the host
    tokens: TokenSource | None
    basic: str  # "user:password" base64, or ""
    source: str  # where these came from, for logs and status

    def authorization(self) -> str:
        """The Authorization header's value now ("" for none, e.g. client certificates)."""
        if self.tokens is not None:
            token = self.tokens.token()
            return f"Bearer {token}" if token else ""
        return f"Basic {self.basic}" if self.basic else ""


def load_credentials(
    kubeconfig: str, environ: Mapping[str, str], service_account_dir: str = SERVICE_ACCOUNT_DIR
) -> Credentials:
    """From `kubeconfig`, or the pod's service account when it is empty. Raises CredentialsError."""
    if kubeconfig:
        try:
            return _from_kubeconfig(kubeconfig, environ)
        except CredentialsError as exc:
            raise CredentialsError(f"kubeconfig {kubeconfig}: {exc}") from None
    return _in_cluster(environ, service_account_dir)


def _in_cluster(environ: Mapping[str, str], sa_dir: str) -> Credentials:
    host, port = environ.get("KUBERNETES_SERVICE_HOST", ""), environ.get("KUBERNETES_SERVICE_PORT", "")
    if not host or not port:
        raise CredentialsError(
            "no kubeconfig given (--kubeconfig / KUBECONFIG) and not in a pod: "
            "KUBERNETES_SERVICE_HOST and KUBERNETES_SERVICE_PORT must be defined"
        )
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise CredentialsError(f"KUBERNETES_SERVICE_PORT {port!r} is not a port number")
    token_file = os.path.join(sa_dir, "token")
    tokens = FileToken(token_file)
    tokens.token()  # fail now, with the path, rather than at the first call
    context = _context(cafile=os.path.join(sa_dir, "ca.crt"), what="the service account's CA")
    return Credentials(
        scheme="https",
        host=host,
        port=int(port),
        base_path="",
        ssl_context=context,
        server_hostname=None,
        tokens=tokens,
        basic="",
        source="the pod's service account",
    )


def _context(
    *, cafile: str | None = None, cadata: str | None = None, insecure: bool = False, what: str = "the CA"
) -> ssl.SSLContext:
    try:
        if insecure:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        else:
            context = ssl.create_default_context(cafile=cafile, cadata=cadata)
    except (OSError, ssl.SSLError, ValueError) as exc:
        raise CredentialsError(f"cannot load {what}: {exc}") from None
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    return context


def _named(items: object, name: str, kind: str) -> dict[str, Any]:
    if not isinstance(items, list):
        raise CredentialsError(f"{kind}s must be a list")
    for item in items:
        if isinstance(item, dict) and item.get("name") == name:
            body = item.get(kind)
            if not isinstance(body, dict):
                raise CredentialsError(f"{kind} {name!r} has no {kind} mapping")
            return body
    raise CredentialsError(f"{kind} {name!r} is not defined")


def _b64(value: object, key: str) -> bytes:
    try:
        return base64.b64decode(str(value), validate=True)
    except (ValueError, TypeError):
        raise CredentialsError(f"{key} is not base64") from None


def _from_kubeconfig(path: str, environ: Mapping[str, str]) -> Credentials:
    text = _read(path, "file")
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise CredentialsError(f"not YAML: {str(exc).splitlines()[0]}") from None
    if not isinstance(doc, dict):
        raise CredentialsError("not a kubeconfig (a mapping with clusters, users and contexts)")
    base = os.path.dirname(os.path.abspath(path))
    current = doc.get("current-context")
    if not isinstance(current, str) or not current:
        raise CredentialsError("no current-context is set")
    context = _named(doc.get("contexts") or [], current, "context")
    cluster = _named(doc.get("clusters") or [], str(context.get("cluster", "")), "cluster")
    user = _named(doc.get("users") or [], str(context.get("user", "")), "user") if context.get("user") else {}

    server = cluster.get("server")
    if not isinstance(server, str) or not server:
        raise CredentialsError(f"cluster {context.get('cluster')!r} has no server")
    url = urllib.parse.urlsplit(server)
    if url.scheme not in ("https", "http") or not url.hostname:
        raise CredentialsError(f"server {server!r} is not an http(s) URL")
    if cluster.get("proxy-url"):
        raise CredentialsError("proxy-url is not supported")

    def file_of(key: str) -> str | None:
        value = cluster.get(key) if key.startswith("certificate") else user.get(key)
        if value is None or value == "":
            return None
        if not isinstance(value, str):
            raise CredentialsError(f"{key} must be a path")
        return value if os.path.isabs(value) else os.path.join(base, value)

    context_ssl: ssl.SSLContext | None = None
    if url.scheme == "https":
        ca_data = cluster.get("certificate-authority-data")
        context_ssl = _context(
            cafile=None if ca_data else file_of("certificate-authority"),
            cadata=_b64(ca_data, "certificate-authority-data").decode(errors="replace") if ca_data else None,
            insecure=bool(cluster.get("insecure-skip-tls-verify")),
            what="certificate-authority",
        )
        _client_certificate(context_ssl, user, file_of)

    if "auth-provider" in user:
        raise CredentialsError("user.auth-provider plugins were removed from Kubernetes clients; use exec")
    tokens: TokenSource | None = None
    if user.get("token"):
        tokens = StaticToken(str(user["token"]))
    elif user.get("tokenFile"):
        tokens = FileToken(file_of("tokenFile") or "")
        tokens.token()
    elif isinstance(user.get("exec"), dict):
        tokens = ExecToken(user["exec"], base, environ)
    basic = ""
    if user.get("username") and tokens is None:
        basic = base64.b64encode(f"{user['username']}:{user.get('password', '')}".encode()).decode()
    return Credentials(
        scheme=url.scheme,
        host=url.hostname,
        port=url.port or (443 if url.scheme == "https" else 80),
        base_path=url.path.rstrip("/"),
        ssl_context=context_ssl,
        server_hostname=str(cluster["tls-server-name"]) if cluster.get("tls-server-name") else None,
        tokens=tokens,
        basic=basic,
        source=f"kubeconfig {path} (context {current})",
    )


def _client_certificate(
    context: ssl.SSLContext, user: Mapping[str, Any], file_of: Callable[[str], str | None]
) -> None:
    """A client certificate and key, from files or inline data (written to a private temp dir for
    the moment ssl needs a path, then removed)."""
    cert_data, key_data = user.get("client-certificate-data"), user.get("client-key-data")
    cert_file, key_file = file_of("client-certificate"), file_of("client-key")
    if not (cert_data or cert_file):
        return
    if not (key_data or key_file):
        raise CredentialsError("a client certificate needs a client key")
    scratch = tempfile.mkdtemp(prefix="gpuvisor-kube-")  # 0700
    try:
        if cert_data:
            cert_file = os.path.join(scratch, "cert.pem")
            with open(cert_file, "wb") as fh:
                fh.write(_b64(cert_data, "client-certificate-data"))
        if key_data:
            key_file = os.path.join(scratch, "key.pem")
            with open(os.open(key_file, os.O_WRONLY | os.O_CREAT, 0o600), "wb") as fh:
                fh.write(_b64(key_data, "client-key-data"))
        assert cert_file is not None and key_file is not None
        context.load_cert_chain(cert_file, key_file)
    except (OSError, ssl.SSLError) as exc:
        raise CredentialsError(f"cannot load the client certificate and key: {exc}") from None
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
