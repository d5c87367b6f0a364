"""The CDI specification's rules, checked before any spec file is written (both roles write one).

The supervisor writes the device plugin's node-wide spec and checks nvidia-ctk's; the DRA
worker writes one spec per claim. `spec_problems` lists every rule a spec breaks (the rules of
the container-device-interface project's reference parser and its spec schema, for the fields
gpuvisor writes), so a bad spec is refused with all its faults named, never written.
"""

from __future__ import annotations

import re

# CDI's name rules (the reference parser of the container-device-interface project):
# vendor and class start with a letter, end with a letter or digit, and hold letters, digits,
# '_', '-' and '.' between; a device name starts and ends with a letter or digit and may also
# hold ':' between.
_VENDOR_OR_CLASS = re.compile(r"[A-Za-z]([A-Za-z0-9_.-]*[A-Za-z0-9])?")
_DEVICE_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9_.:-]*[A-Za-z0-9])?")
_SEMVER = re.compile(r"(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)")
_KNOWN_VERSIONS = ((0, 3, 0), (0, 8, 0))  # oldest and newest CDI spec versions this validator knows
_HOST_PATH_SINCE = (0, 5, 0)
_DEVICE_NODE_TYPES = frozenset({"", "b", "c", "u", "p"})
_HOOK_NAMES = frozenset(
    {"prestart", "createRuntime", "createContainer", "startContainer", "poststart", "poststop"}
)
_MAX_CLASS_LENGTH = 63
_ADDITIONAL_GIDS_SINCE = (0, 7, 0)
CDI_VERSION = "0.5.0"


def _version(text: object) -> tuple[int, int, int] | None:
    if not isinstance(text, str):
        return None
    match = _SEMVER.fullmatch(text)
    if match is None:
        return None
    return (int(match.group(1)), int(match.group(2)), int(match.group(3)))


def _check_env(env: object, where: str, problems: list[str]) -> None:
    if env is None:
        return
    if not isinstance(env, list):
        problems.append(f"{where}: must be a list of NAME=VALUE strings")
        return
    for i, item in enumerate(env):
        if not isinstance(item, str) or item.find("=") <= 0:
            problems.append(f"{where}[{i}] {item!r}: not of the form NAME=VALUE")


def _check_path(value: object, where: str, problems: list[str], *, required: bool = True) -> None:
    if value is None and not required:
        return
    if not isinstance(value, str) or not value:
        problems.append(f"{where}: must be a non-empty path")
    elif not value.startswith("/"):
        problems.append(f"{where} {value!r}: must be an absolute path")


def _check_edits(
    edits: object, where: str, problems: list[str], version: tuple[int, int, int] | None, *, device: bool
) -> None:
    if edits is None:
        if device:
            problems.append(f"{where}: a device needs container edits")
        return
    if not isinstance(edits, dict):
        problems.append(f"{where}: must be a mapping")
        return
    kinds = ("env", "deviceNodes", "mounts", "hooks", "additionalGids", "intelRdt", "netDevices")
    if device and not any(edits.get(k) for k in kinds):
        problems.append(f"{where}: a device's container edits must not be empty")
    _check_env(edits.get("env"), f"{where}.env", problems)
    nodes = edits.get("deviceNodes") or []
    if not isinstance(nodes, list):
        problems.append(f"{where}.deviceNodes: must be a list")
        nodes = []
    for i, node in enumerate(nodes):
        at = f"{where}.deviceNodes[{i}]"
        if not isinstance(node, dict):
            problems.append(f"{at}: must be a mapping")
            continue
        _check_path(node.get("path"), f"{at}.path", problems)
        _check_path(node.get("hostPath"), f"{at}.hostPath", problems, required=False)
        if node.get("hostPath") is not None and version is not None and version < _HOST_PATH_SINCE:
            problems.append(f"{at}.hostPath: needs cdiVersion 0.5.0 or later")
        if node.get("type", "") not in _DEVICE_NODE_TYPES:
            problems.append(f"{at}.type {node.get('type')!r}: must be one of b, c, u, p")
        perms = node.get("permissions", "")
        if not isinstance(perms, str) or (perms != "none" and perms.strip("rwm") != ""):
            problems.append(f"{at}.permissions {perms!r}: must be made of r, w and m")
        for number in ("major", "minor"):
            value = node.get(number)
            if value is not None and (not isinstance(value, int) or value < 0):
                problems.append(f"{at}.{number} {value!r}: must be a non-negative integer")
    gids = edits.get("additionalGids")
    if gids is not None:
        if not isinstance(gids, list) or not all(isinstance(g, int) and g >= 0 for g in gids):
            problems.append(f"{where}.additionalGids: must be a list of non-negative integers")
        elif gids and version is not None and version < _ADDITIONAL_GIDS_SINCE:
            problems.append(f"{where}.additionalGids: needs cdiVersion 0.7.0 or later")
    mounts = edits.get("mounts") or []
    for i, mount in enumerate(mounts if isinstance(mounts, list) else []):
        at = f"{where}.mounts[{i}]"
        if not isinstance(mount, dict):
            problems.append(f"{at}: must be a mapping")
            continue
        for key in ("hostPath", "containerPath"):
            if not isinstance(mount.get(key), str) or not mount.get(key):
                problems.append(f"{at}.{key}: must be a non-empty path")
        options = mount.get("options")
        if options is not None and not (
            isinstance(options, list) and all(isinstance(o, str) for o in options)
        ):
            problems.append(f"{at}.options: must be a list of strings")
    hooks = edits.get("hooks") or []
    for i, hook in enumerate(hooks if isinstance(hooks, list) else []):
        at = f"{where}.hooks[{i}]"
        if not isinstance(hook, dict):
            problems.append(f"{at}: must be a mapping")
            continue
        if hook.get("hookName") not in _HOOK_NAMES:
            problems.append(
                f"{at}.hookName {hook.get('hookName')!r}: must be one of {', '.join(sorted(_HOOK_NAMES))}"
            )
        _check_path(hook.get("path"), f"{at}.path", problems)
        args = hook.get("args")
        if args is not None and not (isinstance(args, list) and all(isinstance(a, str) for a in args)):
            problems.append(f"{at}.args: must be a list of strings")
        _check_env(hook.get("env"), f"{at}.env", problems)


def spec_problems(spec: object) -> list[str]:
    """Every way `spec` breaks the CDI specification's rules (empty: valid)."""
    if not isinstance(spec, dict):
        return ["the spec must be a mapping"]
    problems: list[str] = []
    raw_version = spec.get("cdiVersion")
    version = _version(raw_version)
    if version is None:
        problems.append(f"cdiVersion {raw_version!r}: must be a semantic version such as {CDI_VERSION!r}")
    elif not _KNOWN_VERSIONS[0] <= version <= _KNOWN_VERSIONS[1]:
        problems.append(f"cdiVersion {raw_version!r}: unknown CDI spec version (known: 0.3.0 to 0.8.0)")
    kind = spec.get("kind")
    vendor, slash, klass = kind.partition("/") if isinstance(kind, str) else ("", "", "")
    if not slash or not _VENDOR_OR_CLASS.fullmatch(vendor) or not _VENDOR_OR_CLASS.fullmatch(klass):
        problems.append(
            f"kind {kind!r}: must be <vendor>/<class>, each starting with a letter, ending with a letter or "
            "digit, with letters, digits, '_', '-' and '.' between"
        )
    elif len(klass) > _MAX_CLASS_LENGTH:
        problems.append(f"kind {kind!r}: the class must be at most {_MAX_CLASS_LENGTH} characters")
    devices = spec.get("devices")
    if not isinstance(devices, list) or not devices:
        problems.append("devices: must list at least one device")
        devices = []
    seen: set[str] = set()
    for i, device in enumerate(devices):
        at = f"devices[{i}]"
        if not isinstance(device, dict):
            problems.append(f"{at}: must be a mapping")
            continue
        name = device.get("name")
        if not isinstance(name, str) or not _DEVICE_NAME.fullmatch(name):
            problems.append(
                f"{at}.name {name!r}: must start and end with a letter or digit, with letters, digits, "
                "'_', '-', '.' and ':' between"
            )
        elif name in seen:
            problems.append(f"{at}.name {name!r}: listed twice")
        else:
            seen.add(name)
        _check_edits(device.get("containerEdits"), f"{at}.containerEdits", problems, version, device=True)
    _check_edits(spec.get("containerEdits"), "containerEdits", problems, version, device=False)
    return problems
