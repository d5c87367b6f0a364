"""The three patch formats the fake API server applies, each on plain JSON data.

- strategic merge (`application/strategic-merge-patch+json`), for the fields gpuvisor sends: lists
  with a `patchMergeKey` in the real types (a Node's `status.conditions` and `status.addresses`, by
  `type`) merge element by element, as k8s.io/apimachinery's strategicpatch does;
- JSON merge patch (RFC 7386, `application/merge-patch+json`);
- JSON patch (RFC 6902, `application/json-patch+json`), failing with the words of
  github.com/evanphx/json-patch, which the API server answers as 422 (apiserver's patch.go
  `applyJSPatch`).
"""

from __future__ import annotations

import copy
from typing import Any

STRATEGIC = "application/strategic-merge-patch+json"
MERGE = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"
MERGE_KEYS = {("status", "conditions"): "type", ("status", "addresses"): "type"}


def strategic_merge(target: dict[str, Any], patch: dict[str, Any], path: tuple[str, ...] = ()) -> None:
    """A strategic-merge patch for the fields gpuvisor sends: maps merge, null deletes, lists with a
    merge key (a Node's conditions by `type`) merge element by element, other lists are replaced."""
    for key, value in patch.items():
        here = (*path, key)
        if value is None:
            target.pop(key, None)
        elif isinstance(value, dict) and isinstance(target.get(key), dict):
            strategic_merge(target[key], value, here)
        elif isinstance(value, list) and here in MERGE_KEYS and isinstance(target.get(key), list):
            merge_key = MERGE_KEYS[here]
            merged = target[key]
            for item in value:
                existing = next(
                    (e for e in merged if isinstance(e, dict) and e.get(merge_key) == item.get(merge_key)),
                    None,
                )
                if existing is None:
                    merged.append(copy.deepcopy(item))
                else:
                    strategic_merge(existing, item, here)
        else:
            target[key] = copy.deepcopy(value)


def merge_patch(target: dict[str, Any], patch: dict[str, Any]) -> None:
    """RFC 7386 JSON merge patch: maps merge, null deletes, everything else (lists too) replaces."""
    for key, value in patch.items():
        if value is None:
            target.pop(key, None)
        elif isinstance(value, dict) and isinstance(target.get(key), dict):
            merge_patch(target[key], value)
        else:
            target[key] = copy.deepcopy(value)


class JsonPatchError(ValueError):
    """An RFC 6902 patch that does not apply; the text as github.com/evanphx/json-patch words it."""


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise JsonPatchError(f"invalid path {path!r}")
    return [part.replace("~1", "/").replace("~0", "~") for part in path[1:].split("/")]


def _container(doc: Any, parts: list[str], path: str, op: str) -> tuple[Any, str]:
    node = doc
    for part in parts[:-1]:
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            raise JsonPatchError(f"{op} operation does not apply: doc is missing path: {path!r}")
    return node, parts[-1]


def json_patch(doc: dict[str, Any], ops: Any) -> dict[str, Any]:
    """RFC 6902 on a copy of `doc`: add, remove, replace, move, copy, test; the first op that does
    not apply fails the whole patch (the API server answers 422: apiserver's patch.go
    `applyJSPatch`, `errors.NewGenericServerResponse(http.StatusUnprocessableEntity, ...)`)."""
    if not isinstance(ops, list):
        raise JsonPatchError("the patch is not a JSON array of operations")
    out = copy.deepcopy(doc)
    for op in ops:
        if (
            not isinstance(op, dict)
            or not isinstance(op.get("op"), str)
            or not isinstance(op.get("path"), str)
        ):
            raise JsonPatchError(f"invalid operation {op!r}")
        kind, path = op["op"], op["path"]
        parts = _pointer(path)
        if not parts:
            raise JsonPatchError(f"{kind} on the whole document is not supported here")
        if kind == "test":
            node, last = _container(out, parts, path, kind)
            current = node.get(last) if isinstance(node, dict) else None
            if not isinstance(node, dict) or last not in node or current != op.get("value"):
                raise JsonPatchError(f"testing value {path} failed: test failed")
            continue
        if kind in ("move", "copy"):
            source = _pointer(str(op.get("from", "")))
            holder, key = _container(out, source, str(op.get("from")), kind)
            if not isinstance(holder, dict) or key not in holder:
                raise JsonPatchError(
                    f"{kind} operation does not apply: doc is missing from path: {op.get('from')!r}"
                )
            value = holder.pop(key) if kind == "move" else copy.deepcopy(holder[key])
            node, last = _container(out, parts, path, kind)
            node[last] = value
            continue
        node, last = _container(out, parts, path, kind)
        if not isinstance(node, dict):
            raise JsonPatchError(f"{kind} into a list is not supported here: {path!r}")
        if kind == "add":
            node[last] = copy.deepcopy(op.get("value"))
        elif kind == "remove":
            if last not in node:
                raise JsonPatchError(f"remove operation does not apply: doc is missing path: {path!r}")
            del node[last]
        elif kind == "replace":
            if last not in node:
                raise JsonPatchError(f"replace operation does not apply: doc is missing key: {path!r}")
            node[last] = copy.deepcopy(op.get("value"))
        else:
            raise JsonPatchError(f"unexpected kind {kind!r}")
    return out
