"""Credentials inside URLs: what to show instead of them, and which strings to scrub.

`HTTP_ENDPOINT` may carry a user and password (`https://user:pass@host/`) and keys in its
query (`?api_key=…`). Anything that shows the URL (`/status`, `check-config`, logs, errors)
shows `redact_url(url)`; anything that shows text a receiver sent back scrubs
`url_secrets(url)` from it, since receivers like to echo the request they refused.
"""

from __future__ import annotations

import re
from urllib.parse import unquote, urlsplit

REDACTED = "<redacted>"


def _split(url: str) -> tuple[str, str, str, str, str] | None:
    try:
        parts = urlsplit(url)
    except ValueError:
        return None
    return parts.scheme, parts.netloc, parts.path, parts.query, parts.fragment


def _redact_query(query: str) -> str:
    """Names stay (they say what was set), values go; a bare item may be a key itself."""
    if not query:
        return query
    out: list[str] = []
    for item in query.split("&"):
        name, sep, _value = item.partition("=")
        out.append(f"{name}={REDACTED}" if sep else REDACTED if item else "")
    return "&".join(out)


def _bad_port(url: str) -> bool:
    try:
        urlsplit(url).port  # noqa: B018 - raises for a port that is not a number
    except ValueError:
        return True
    return False


def redact_url(url: str) -> str:
    """The URL with its userinfo, query values and fragment replaced; never raises.

    Conservative where the URL is odd: an "@" before the query hides everything from the
    scheme to the last such "@" (a password with a raw "/" splits differently in every
    parser); an "@" after a raw "?" or "#" (a userinfo cut short) or a port that is not a
    number hides the whole authority and query; a URL too broken to split is replaced whole.
    """
    if not url:
        return url
    split = _split(url)
    if split is None:
        return REDACTED
    scheme, netloc, path, query, fragment = split
    if not scheme or not url.startswith(f"{scheme}://"):
        return REDACTED
    rest = url[len(scheme) + 3 :]
    cut = re.search(r"[?#]", rest)
    before_query = rest[: cut.start()] if cut else rest
    if rest.rfind("@") >= len(before_query):  # the last "@" comes after a "?" or "#"
        return f"{scheme}://{REDACTED}"
    if "@" in before_query:
        shown = f"{scheme}://{REDACTED}@{before_query.rpartition('@')[2]}"
    else:
        shown = f"{scheme}://{REDACTED if _bad_port(url) else netloc}{path}"
    if query or "?" in url:
        shown += "?" + _redact_query(query)
    if fragment or "#" in url:
        shown += "#" + (REDACTED if fragment else "")
    return shown


def has_userinfo(url: str) -> bool:
    split = _split(url)
    return split is not None and "@" in split[1]


def _tail_values(rest: str) -> set[str]:
    """Query values, bare query items and the fragment of what follows the authority."""
    cut = re.search(r"[?#]", rest)
    if cut is None:
        return set()
    tail = rest[cut.start() :]
    query, fragment = "", tail[1:]
    if tail[0] == "?":
        query, _, fragment = tail[1:].partition("#")
    found = {fragment}
    for item in re.split(r"[&#]", f"{query}&{fragment}"):  # a raw "#" cuts a value short
        _name, sep, value = item.partition("=")
        found.add(value if sep else item)
    return found


def url_secrets(url: str) -> list[str]:
    """Strings that must not appear in anything shown: the URL itself, its userinfo and each
    part of it, query values, the fragment; raw, percent-decoded and without the tabs and
    newlines parsers drop. Read by hand, so a URL too odd to parse still yields its parts.
    Longest first, so a secret containing another is replaced whole."""
    if not url:
        return []
    _scheme, sep, rest = url.partition("://")
    rest = rest if sep else url
    cut = re.search(r"[?#]", rest)
    before_query = rest[: cut.start()] if cut else rest
    found = {url} | _tail_values(rest)
    if rest.rfind("@") >= len(before_query):
        # a userinfo cut short by a raw "?" or "#": it runs to the last "@"
        userinfo, _, after = rest.rpartition("@")
        found.add(userinfo)
        found.update(re.split(r"[:/@?#&=]", userinfo))
        found.update(_tail_values(after))
    elif "@" in before_query:
        userinfo = before_query.rpartition("@")[0]
        found.add(userinfo)
        found.update(re.split(r"[:/@]", userinfo))
    else:
        authority = before_query.partition("/")[0]
        port = authority.rpartition("]")[2].partition(":")[2]
        if not port.isdigit() and ":" in authority.rpartition("]")[2]:
            found.add(authority)
            found.update(authority.split(":"))
    found.update({unquote(s) for s in found})
    found.update({re.sub(r"[\t\r\n]", "", s) for s in found})
    return sorted((s for s in found if s), key=len, reverse=True)


def scrub(text: str, secrets: list[str] | tuple[str, ...]) -> str:
    """`text` with every secret replaced by the redaction marker."""
    for secret in sorted((s for s in secrets if s), key=len, reverse=True):
        text = text.replace(secret, REDACTED)
    return text
