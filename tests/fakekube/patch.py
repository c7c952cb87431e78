"""The three PATCH bodies the API server accepts, applied with the API server's semantics.

- JSON merge patch (RFC 7386): maps merge recursively, `null` deletes a key, lists replace.
- Strategic merge patch: like merge patch, but lists with a known merge key merge element by
  element, and the `$patch`, `$retainKeys`, `$deleteFromPrimitiveList/…` and
  `$setElementOrder/…` directives are honoured.
- JSON patch (RFC 6902): add/remove/replace/move/copy/test on RFC 6901 pointers.

Errors raise PatchError with the HTTP status the API server answers (400 for a body that is not
a patch, 422 for a patch that cannot be applied).
"""

from __future__ import annotations

import copy
from typing import Any

# field name → merge key of the list (patchMergeKey in the Kubernetes API types).
MERGE_KEYS: dict[str, str] = {
    "ownerReferences": "uid",
    "conditions": "type",
    "taints": "key",
    "addresses": "type",
    "containers": "name",
    "initContainers": "name",
    "ephemeralContainers": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "env": "name",
    "ports": "containerPort",
    "containerStatuses": "name",
    "initContainerStatuses": "name",
    "imagePullSecrets": "name",
    "hostAliases": "ip",
}
# lists of scalars whose patch strategy is "merge" (union) instead of replace.
PRIMITIVE_MERGE_LISTS = frozenset({"finalizers", "podCIDRs"})

MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"
JSON_PATCH = "application/json-patch+json"
APPLY_PATCH = "application/apply-patch+yaml"


class PatchError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


# ---- JSON merge patch ---------------------------------------------------------------------


def merge_patch(target: Any, patch: Any) -> Any:
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


# ---- strategic merge patch ----------------------------------------------------------------


def strategic_merge_patch(target: Any, patch: Any) -> Any:
    if not isinstance(patch, dict):
        raise PatchError(400, "strategic merge patch body must be a JSON object")
    return _smp_map(target if isinstance(target, dict) else {}, patch)


def _smp_map(target: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any] | None:
    directive = patch.get("$patch")
    if directive == "delete":
        return None
    if directive == "replace":
        return {k: copy.deepcopy(v) for k, v in patch.items() if k != "$patch"}
    if directive not in (None, "merge"):
        raise PatchError(422, f"unknown patch type: {directive!r} in map")
    result = copy.deepcopy(target)
    retain = patch.get("$retainKeys")
    for key, value in patch.items():
        if key in ("$patch", "$retainKeys") or key.startswith("$setElementOrder/"):
            continue
        if key.startswith("$deleteFromPrimitiveList/"):
            field = key.split("/", 1)[1]
            if not isinstance(value, list):
                raise PatchError(422, f"{key} must be a list")
            current = result.get(field)
            if isinstance(current, list):
                result[field] = [v for v in current if v not in value]
            continue
        if value is None:
            result.pop(key, None)
        elif isinstance(value, dict):
            merged = _smp_map(result.get(key) if isinstance(result.get(key), dict) else {}, value)
            if merged is None:
                result.pop(key, None)
            else:
                result[key] = merged
        elif isinstance(value, list):
            result[key] = _smp_list(key, result.get(key), value)
        else:
            result[key] = copy.deepcopy(value)
    if isinstance(retain, list):
        result = {k: v for k, v in result.items() if k in retain}
    return result


def _smp_list(field: str, current: Any, patch: list[Any]) -> list[Any]:
    current_list = current if isinstance(current, list) else []
    if any(isinstance(v, dict) and v.get("$patch") == "replace" for v in patch):
        return [copy.deepcopy(v) for v in patch if not (isinstance(v, dict) and "$patch" in v)]
    merge_key = MERGE_KEYS.get(field)
    if merge_key is not None and all(isinstance(v, dict) for v in patch):
        result = copy.deepcopy(current_list)
        for item in patch:
            if merge_key not in item:
                raise PatchError(422, f"map in {field} has no merge key {merge_key!r}")
            index = next(
                (
                    i
                    for i, old in enumerate(result)
                    if isinstance(old, dict) and old.get(merge_key) == item[merge_key]
                ),
                None,
            )
            if item.get("$patch") == "delete":
                if index is not None:
                    del result[index]
                continue
            if index is None:
                result.append({k: v for k, v in copy.deepcopy(item).items() if k != "$patch"})
            else:
                merged = _smp_map(result[index], item)
                if merged is not None:
                    result[index] = merged
        return result
    if field in PRIMITIVE_MERGE_LISTS:
        result = list(current_list)
        result.extend(v for v in patch if v not in result)
        return result
    return copy.deepcopy(patch)


# ---- JSON patch ---------------------------------------------------------------------------


def _pointer(path: Any) -> list[str]:
    if not isinstance(path, str) or (path and not path.startswith("/")):
        raise PatchError(422, f"invalid JSON pointer: {path!r}")
    if path == "":
        return []
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _parent(doc: Any, parts: list[str], path: str) -> Any:
    node = doc
    for part in parts[:-1]:
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            raise PatchError(422, f"doc is missing path: {path}")
    return node


def _get(doc: Any, path: str) -> Any:
    parts = _pointer(path)
    if not parts:
        return doc
    parent = _parent(doc, parts, path)
    last = parts[-1]
    if isinstance(parent, dict) and last in parent:
        return parent[last]
    if isinstance(parent, list) and last.isdigit() and int(last) < len(parent):
        return parent[int(last)]
    raise PatchError(422, f"doc is missing path: {path}")


def _remove(doc: Any, path: str) -> Any:
    parts = _pointer(path)
    if not parts:
        raise PatchError(422, "cannot remove the root")
    parent = _parent(doc, parts, path)
    last = parts[-1]
    if isinstance(parent, dict) and last in parent:
        return parent.pop(last)
    if isinstance(parent, list) and last.isdigit() and int(last) < len(parent):
        return parent.pop(int(last))
    raise PatchError(422, f"unable to remove nonexistent key: {last}: missing value")


def _add(doc: Any, path: str, value: Any, *, replace: bool = False) -> Any:
    parts = _pointer(path)
    if not parts:
        return copy.deepcopy(value)
    parent = _parent(doc, parts, path)
    last = parts[-1]
    if isinstance(parent, dict):
        if replace and last not in parent:
            raise PatchError(422, f"replace operation does not apply: doc is missing key: {path}")
        parent[last] = copy.deepcopy(value)
    elif isinstance(parent, list):
        if last == "-" and not replace:
            parent.append(copy.deepcopy(value))
        elif last.isdigit() and int(last) <= len(parent) - (1 if replace else 0):
            if replace:
                parent[int(last)] = copy.deepcopy(value)
            else:
                parent.insert(int(last), copy.deepcopy(value))
        else:
            raise PatchError(422, f"index out of range: {path}")
    else:
        raise PatchError(422, f"doc is missing path: {path}")
    return doc


def json_patch(target: Any, operations: Any) -> Any:
    if not isinstance(operations, list):
        raise PatchError(400, "json patch body must be a JSON array of operations")
    doc = copy.deepcopy(target)
    for op in operations:
        if not isinstance(op, dict) or "op" not in op:
            raise PatchError(422, f"invalid operation {op!r}")
        kind = op["op"]
        path = op.get("path")
        if kind in ("add", "replace", "test") and "value" not in op:
            raise PatchError(422, f"operation {kind} needs a value")
        if kind == "add":
            doc = _add(doc, path, op["value"])
        elif kind == "replace":
            doc = _add(doc, path, op["value"], replace=True)
        elif kind == "remove":
            _remove(doc, path)
        elif kind == "move":
            value = _remove(doc, op.get("from"))
            doc = _add(doc, path, value)
        elif kind == "copy":
            doc = _add(doc, path, _get(doc, op.get("from")))
        elif kind == "test":
            if _get(doc, path) != op["value"]:
                raise PatchError(422, f"testing value {path} failed: test failed")
        else:
            raise PatchError(422, f"unexpected kind: {kind!r}")
    return doc


def apply(content_type: str, target: dict[str, Any], body: Any) -> dict[str, Any]:
    """The object after applying `body` of the given Content-Type to `target`."""
    media = content_type.split(";", 1)[0].strip().lower()
    if media == MERGE_PATCH:
        if not isinstance(body, dict):
            raise PatchError(400, "merge patch body must be a JSON object")
        result = merge_patch(target, body)
    elif media == STRATEGIC_MERGE_PATCH:
        result = strategic_merge_patch(target, body)
    elif media == JSON_PATCH:
        result = json_patch(target, body)
    else:
        raise PatchError(415, f"the body of the request was in an unknown format - {media}")
    if not isinstance(result, dict):
        raise PatchError(422, "the patch replaced the object with a non-object")
    return result
