"""The names of the workers' sockets in the kubelet's device-plugins dir, in one place.

A worker names each server start `gpuvisor-<resource name>-<tag><nn>.sock`: the tag (6 hex
digits) is the one the supervisor gave that worker process and recorded in its run dir, nn counts
the process's server starts. The supervisor removes only dead sockets whose name carries a tag it
recorded, so the worker that makes a name and the supervisor that recognises it must agree on
the format: both use this module.
"""

from __future__ import annotations

import os
import re

# The kubelet's own socket in that dir. Here, not only in common.kubeletapi (which re-exports it),
# so that the supervisor, which needs the name but no kubelet API, never loads protobuf.
KUBELET_SOCKET_NAME = "kubelet.sock"
# The DRA driver's sockets (kubernetes' kubeletplugin helper names them so): the service in
# `<plugins dir>/<driver>/`, the registration in the plugin watcher's dir. Here for the same reason:
# the supervisor checks their paths at config load without loading the DRA API's stubs.
DRA_SERVICE_SOCKET_NAME = "dra.sock"


def dra_registration_socket_name(driver: str) -> str:
    """The DRA registration socket's name in the registry dir: `<driver>-reg.sock`."""
    return f"{driver}-reg.sock"


SOCKET_PREFIX = "gpuvisor-"
UNIX_PATH_MAX = 107  # bytes of a unix socket address, without the trailing NUL
TAG = re.compile(r"[0-9a-f]{6}")
_NAME = re.compile(rf"{re.escape(SOCKET_PREFIX)}(.+)-([0-9a-f]{{6}})[0-9a-f]{{2}}\.sock")


def new_tag() -> str:
    """A fresh tag for one worker process."""
    # os.urandom, as secrets.token_hex does: `secrets` would bring hmac, hashlib and OpenSSL's
    # libcrypto into every worker for three random bytes.
    return os.urandom(3).hex()


def is_tag(text: str) -> bool:
    return TAG.fullmatch(text) is not None


def socket_name(resource: str, tag: str, n: int, plugin_dir: str = "") -> str:
    """`gpuvisor-<name>-<tag><nn>.sock` for server start `n` of the worker with `tag`.

    The resource name is cut short when the whole path would not fit a unix socket address
    (107 bytes): a 63-character name renamed to `<name>.shared` in the kubelet's usual dir would.
    """
    name = resource.split("/", 1)[-1]
    suffix = f"-{tag}{n % 256:02x}.sock"
    room = UNIX_PATH_MAX - len(os.path.join(plugin_dir, "").encode()) - len(SOCKET_PREFIX) - len(suffix)
    if len(name.encode()) > room:
        name = name.encode()[: max(room, 1)].decode("utf-8", "ignore") or "r"
    return f"{SOCKET_PREFIX}{name}{suffix}"


def shortest_socket_path(plugin_dir: str) -> str:
    """The shortest path a worker's socket can have in `plugin_dir`: a one-byte resource name.
    Longer names are cut short to fit (`socket_name`), so when this path fits, every worker's does."""
    return os.path.join(plugin_dir, socket_name("r", "0" * 6, 0))


def made_by(name: str, resource: str, tag: str) -> bool:
    """Is `name` a socket name the worker of `resource` with `tag` would bind (at any start)?"""
    m = _NAME.fullmatch(name)
    if m is None:
        return False
    # The worker cuts a long resource name short to fit the socket address: a prefix counts.
    return m.group(2) == tag and resource.split("/", 1)[-1].startswith(m.group(1))
