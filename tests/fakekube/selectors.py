"""fieldSelector and labelSelector parsing and matching, as the API server does them."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

Predicate = Callable[[dict[str, Any]], bool]


class SelectorError(ValueError):
    pass


def _field_value(obj: dict[str, Any], path: str) -> str:
    node: Any = obj
    for part in path.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    if node is None:
        return ""
    if isinstance(node, bool):
        return "true" if node else "false"
    return str(node)


def field_selector(text: str | None) -> Predicate:
    """`spec.nodeName=n1,metadata.namespace!=kube-system` (only = == != and AND)."""
    terms: list[tuple[str, bool, str]] = []
    for raw in (text or "").split(","):
        term = raw.strip()
        if not term:
            continue
        match = re.fullmatch(r"([A-Za-z0-9_.]+)\s*(==|=|!=)\s*(.*)", term)
        if match is None:
            raise SelectorError(f'invalid field selector: "{term}"')
        terms.append((match.group(1), match.group(2) != "!=", match.group(3)))

    def predicate(obj: dict[str, Any]) -> bool:
        return all((_field_value(obj, path) == value) == equal for path, equal, value in terms)

    return predicate


_SET_TERM = re.compile(r"^([A-Za-z0-9_./-]+)\s+(in|notin)\s+\(([^)]*)\)$")
_EQ_TERM = re.compile(r"^([A-Za-z0-9_./-]+)\s*(==|=|!=)\s*([A-Za-z0-9_.-]*)$")
_EXISTS_TERM = re.compile(r"^(!?)([A-Za-z0-9_./-]+)$")


def _split_terms(text: str) -> list[str]:
    terms, depth, current = [], 0, []
    for ch in text:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == "," and depth == 0:
            terms.append("".join(current).strip())
            current = []
        else:
            current.append(ch)
    terms.append("".join(current).strip())
    return [t for t in terms if t]


def label_selector(text: str | None) -> Predicate:
    """`app=x`, `app!=x`, `app in (a,b)`, `app notin (a)`, `app`, `!app`, joined with commas."""
    checks: list[Callable[[dict[str, str]], bool]] = []
    for term in _split_terms(text or ""):
        if m := _SET_TERM.match(term):
            key, op = m.group(1), m.group(2)
            values = {v.strip() for v in m.group(3).split(",") if v.strip()}
            if op == "in":
                checks.append(lambda lb, k=key, vs=values: lb.get(k) in vs)
            else:
                checks.append(lambda lb, k=key, vs=values: lb.get(k) not in vs)
        elif m := _EQ_TERM.match(term):
            key, op, value = m.group(1), m.group(2), m.group(3)
            if op == "!=":
                checks.append(lambda lb, k=key, v=value: lb.get(k) != v)
            else:
                checks.append(lambda lb, k=key, v=value: lb.get(k) == v)
        elif m := _EXISTS_TERM.match(term):
            negate, key = m.group(1) == "!", m.group(2)
            checks.append(lambda lb, k=key, n=negate: (k in lb) != n)
        else:
            raise SelectorError(f'unable to parse requirement: "{term}"')

    def predicate(obj: dict[str, Any]) -> bool:
        labels = (obj.get("metadata") or {}).get("labels") or {}
        return all(check(labels) for check in checks)

    return predicate
