"""ResourceClaims: where the DRA worker gets them (`ClaimSource`) and what it checks in one.

The kubelet names a claim by namespace, name and UID; the claim itself (which devices the
scheduler allocated) lives in the API server. A `ClaimSource` fetches it by namespace and name
as `resource.k8s.io/v1` JSON, the shape the API server serves; `allocated_devices` checks it the
way the kubelet-plugin helper of k8s.io/dynamic-resource-allocation does (allocated, the UID the
kubelet asked for) and, beyond that, that its results for this driver name this node's pool and
devices this node has. Everything wrong becomes a `ClaimError` whose text goes into the
response for that claim.

Sources: `SupervisorClaimSource` asks the supervisor over the control channel, which fetches the
claim from the API server with the node's one API client (`GET resourceclaims/<ns>/<name>`; why
the worker holds no client of its own is measured in docs/dra.md);
`DirectoryClaimSource` reads `<dir>/<namespace>/<name>.json` (`--dra-claims-dir`: simulated
nodes, the demo, tests without an API server).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Container, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from common.messages import ClaimReply, ClaimRequest
from worker.dra.asking import Asking

MAX_CLAIM_BYTES = 1 << 20  # a ResourceClaim is a few KiB; the API server caps objects at 1.5 MiB
MAX_RESULTS = 32  # AllocationResultsMaxSize (resource.k8s.io/v1)
# How long a prepare waits for the supervisor's answer: under the kubelet's 45 s call timeout, so
# the kubelet gets this claim's error (and retries) rather than a failed call.
SUPERVISOR_TIMEOUT_S = 20.0
# Namespaces and claim names are DNS labels / subdomains: no '/', no "..", nothing a path could abuse.
_NAMESPACE = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
_NAME = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")


class ClaimError(Exception):
    """A claim that cannot be prepared; the text goes into the kubelet's response for it."""


class ClaimNotFound(ClaimError):
    """The source has no such claim."""


@dataclass(frozen=True)
class ClaimRef:
    """A claim as the kubelet names it."""

    namespace: str
    name: str
    uid: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass(frozen=True)
class AllocatedDevice:
    """One allocation result of this driver: the claim's request (subrequest suffix stripped,
    as the kubelet-plugin helper strips it) and the device."""

    request: str
    pool: str
    device: str
    admin_access: bool = False
    share_id: str | None = None
    result_request: str = ""  # the request as the result names it (`<request>/<subrequest>`)
    consumed_memory: int | None = None  # consumedCapacity.memory in bytes: a GPU shared by memory


class ClaimSource(Protocol):
    """Fetches a ResourceClaim (resource.k8s.io/v1 JSON) by namespace and name.

    Raises `ClaimNotFound` when there is none, and `ClaimError` when the source cannot say (the
    API server away, an unreadable file): the kubelet retries a failed prepare.
    """

    def get(self, namespace: str, name: str) -> Mapping[str, Any]: ...


def check_ref(ref: ClaimRef) -> None:
    """The kubelet's names are a namespace, a DNS subdomain and a UID: refuse anything else."""
    if not _NAMESPACE.fullmatch(ref.namespace):
        raise ClaimError(f"claim {ref}: {ref.namespace!r} is not a namespace name")
    if not _NAME.fullmatch(ref.name):
        raise ClaimError(f"claim {ref}: {ref.name!r} is not a claim name")
    if not ref.uid or len(ref.uid) > 128:
        raise ClaimError(f"claim {ref}: a UID of 1 to 128 characters is required, got {len(ref.uid)}")


class DirectoryClaimSource:
    """Claims from `<dir>/<namespace>/<name>.json`, each a ResourceClaim as the API server serves it."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def get(self, namespace: str, name: str) -> Mapping[str, Any]:
        check_ref(ClaimRef(namespace, name, "-"))
        path = os.path.join(self.directory, namespace, f"{name}.json")
        try:
            with open(path, "rb") as fh:
                data = fh.read(MAX_CLAIM_BYTES + 1)
        except FileNotFoundError:
            raise ClaimNotFound(f"claim {namespace}/{name} not found ({path} does not exist)") from None
        except OSError as exc:
            raise ClaimError(f"claim {namespace}/{name}: cannot read {path}: {exc.strerror or exc}") from None
        return parse_claim(data, path, f"claim {namespace}/{name}")


def parse_claim(data: bytes | str, where: str, what: str) -> dict[str, Any]:
    """A claim's JSON text as an object; ClaimError saying what is wrong with it."""
    if len(data) > MAX_CLAIM_BYTES:
        raise ClaimError(f"{what}: {where} is over {MAX_CLAIM_BYTES} bytes")
    try:
        obj = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise ClaimError(f"{what}: {where} is not JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise ClaimError(f"{what}: {where} holds a {type(obj).__name__}, not an object")
    return obj


class SupervisorClaimSource:
    """Claims the supervisor fetches from the API server, asked for over the control channel.

    `get` runs on a gRPC thread: it hands a `ClaimRequest` to `send` (which posts it to the main
    thread, the owner of the DEALER socket) and waits for `answer` (called on the main thread with
    the supervisor's `ClaimReply`) at most `timeout` seconds. Unanswered requests are dropped at
    their timeout, so nothing waits forever on a supervisor that is restarting.
    """

    def __init__(
        self, resource: str, send: Callable[[ClaimRequest], None], timeout: float = SUPERVISOR_TIMEOUT_S
    ) -> None:
        self.resource = resource
        self._asking: Asking[ClaimReply] = Asking(send, timeout, error=ClaimError)

    def get(self, namespace: str, name: str) -> Mapping[str, Any]:
        check_ref(ClaimRef(namespace, name, "-"))
        what = f"claim {namespace}/{name}"
        reply = self._asking.ask(
            ClaimRequest(self.resource, "", namespace, name),
            f"{what}: the supervisor, which fetches claims from the API server, did not answer",
            raise_error=False,
        )
        if reply.not_found:
            raise ClaimNotFound(f"{what} not found: {reply.error}")
        if reply.error:
            raise ClaimError(f"{what}: {reply.error}")
        return parse_claim(reply.claim_json, "the API server's answer", what)

    def answer(self, reply: ClaimReply) -> None:
        """The supervisor's reply (main thread); one nobody waits for any more is dropped."""
        self._asking.answer(reply)

    def waiting(self) -> int:
        return self._asking.waiting()


def _field(obj: Mapping[str, Any], path: str) -> Any:
    """obj["a"]["b"]... for path "a.b"; None where any step is missing or not an object."""
    value: Any = obj
    for part in path.split("."):
        if not isinstance(value, Mapping):
            return None
        value = value.get(part)
    return value


def base_request(name: str) -> str:
    """The claim's request a result belongs to: `<request>/<subrequest>` -> `<request>`."""
    return name.partition("/")[0]


def allocated_devices(
    claim: Mapping[str, Any], ref: ClaimRef, *, driver: str, pool: str, devices: Container[str]
) -> list[AllocatedDevice]:
    """This driver's devices in the claim's allocation, checked; raises ClaimError naming what is wrong."""
    uid = _field(claim, "metadata.uid")
    if uid != ref.uid:
        # The helper's words: the claim of that name is not the one the kubelet prepares.
        raise ClaimError(f"claim {ref} got replaced: it has UID {uid!r}, the kubelet asked for {ref.uid!r}")
    allocation = _field(claim, "status.allocation")
    if not isinstance(allocation, Mapping):
        raise ClaimError(f"claim {ref} not allocated")
    results = _field(allocation, "devices.results")
    if not isinstance(results, list):
        raise ClaimError(f"claim {ref}: its allocation has no device results")
    if len(results) > MAX_RESULTS:
        raise ClaimError(
            f"claim {ref}: {len(results)} allocation results, the API allows at most {MAX_RESULTS}"
        )
    out: list[AllocatedDevice] = []
    for i, result in enumerate(results):
        if not isinstance(result, Mapping):
            raise ClaimError(f"claim {ref}: allocation result {i} is not an object")
        if result.get("driver") != driver:
            continue  # another driver's device: prepared by that driver's plugin
        request, result_pool, device = (result.get(k) for k in ("request", "pool", "device"))
        if not all(isinstance(v, str) and v for v in (request, result_pool, device)):
            raise ClaimError(f"claim {ref}: allocation result {i} lacks its request, pool or device")
        assert isinstance(request, str) and isinstance(result_pool, str) and isinstance(device, str)
        if result_pool != pool:
            raise ClaimError(
                f"claim {ref}: device {device} was allocated from pool {result_pool!r}, not this node's pool {pool!r}"
            )
        if device not in devices:
            raise ClaimError(f"claim {ref}: device {device} of pool {pool} is not on this node (any more)")
        share = result.get("shareID")
        memory = (result.get("consumedCapacity") or {}).get("memory")
        if memory is not None:
            from worker.dra.quantity import QuantityError, json_quantity  # only a share needs it

            try:
                memory = json_quantity(memory)
            except QuantityError as exc:
                raise ClaimError(
                    f"claim {ref}: allocation result {i}: consumedCapacity.memory: {exc}"
                ) from None
        out.append(
            AllocatedDevice(
                request=base_request(request),
                pool=result_pool,
                device=device,
                admin_access=result.get("adminAccess") is True,
                share_id=share if isinstance(share, str) and share else None,
                result_request=request,
                consumed_memory=memory,
            )
        )
    if not out:
        raise ClaimError(f"claim {ref}: its allocation has no device of driver {driver}")
    return out
