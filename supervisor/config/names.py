"""Resource names and device references in the config file, checked by NVIDIA's rules (and the
name of the DRA driver a node in `--mode dra` is).

- A resource name (`resources.*[].name`, `sharing.*.resources[].name` / `rename`) is
  `api/config/v1/resources.go` NewResourceName: `nvidia.com/` is prefixed unless present, the
  whole is at most 63 characters, and the part after the first `/` is a DNS-1123 subdomain
  (lower case, digits, '-' and '.'). So `GPU`, `my_gpu` and `other.com/gpu` are refused.
- A device reference (`sharing.*.resources[].devices[]`) is `replicas.go`'s
  ReplicatedDeviceRef: a GPU index (an unsigned integer, no sign or spaces), a MIG index `i:j`,
  `GPU-<uuid>`, or `MIG-<uuid>` / `MIG-GPU-<uuid>/<gi>/<ci>`, with uuid.Parse's forms.
"""

from __future__ import annotations

from typing import Final

from supervisor.config import golang
from supervisor.config.errors import Invalid, show

RESOURCE_DOMAIN: Final = "nvidia.com"
MAX_RESOURCE_NAME_LENGTH: Final = 63  # NVIDIA's limit on the fully-qualified name
SHARED_SUFFIX: Final = ".shared"
DRA_DRIVER: Final = "gpu.nvidia.com"  # the DRA driver a node in --mode dra is (NVIDIA's driver name)


def new_resource_name(name: str) -> str:
    """NVIDIA's NewResourceName: the fully-qualified name, or Invalid."""
    full = name if name.startswith(f"{RESOURCE_DOMAIN}/") else f"{RESOURCE_DOMAIN}/{name}"
    if len(full.encode()) > MAX_RESOURCE_NAME_LENGTH:
        raise Invalid(
            f"fully-qualified resource name must be at most {MAX_RESOURCE_NAME_LENGTH} characters: {full}"
        )
    part = full.split("/", 1)[1]
    if not golang.is_dns1123_subdomain(part):
        raise Invalid(
            f"invalid resource name {show(full)}: the part after {RESOURCE_DOMAIN}/ must be lower-case letters, "
            "digits, '-' and '.', starting and ending with a letter or digit (a DNS-1123 subdomain)"
        )
    return full


def _is_uint(text: str) -> bool:
    try:
        golang.parse_uint(text, 10, 64)
    except ValueError:
        return False
    return True


def is_gpu_index(ref: str) -> bool:
    return _is_uint(ref)


def is_mig_index(ref: str) -> bool:
    parts = ref.split(":", 1)
    return len(parts) == 2 and all(_is_uint(p) for p in parts)


def is_gpu_uuid(ref: str) -> bool:
    return ref.startswith("GPU-") and golang.is_uuid(ref[4:])


def is_mig_uuid(ref: str) -> bool:
    if not ref.startswith("MIG-"):
        return False
    suffix = ref[4:]
    if golang.is_uuid(suffix):
        return True
    parts = suffix.split("/", 2)
    return len(parts) == 3 and is_gpu_uuid(parts[0]) and all(_is_uint(p) for p in parts[1:])


def device_ref(text: str) -> str:
    """A device reference as gpuvisor matches it: indexes without leading zeros ("01" is GPU 1), UUIDs as given."""
    if is_gpu_index(text):
        return str(int(text))
    if is_mig_index(text):
        gpu, mig = text.split(":", 1)
        return f"{int(gpu)}:{int(mig)}"
    if is_gpu_uuid(text) or is_mig_uuid(text):
        return text
    raise Invalid(
        f"invalid device reference {show(text)}: use a GPU index, an i:j MIG index, "
        "or a GPU-<uuid> / MIG-<uuid> UUID"
    )
