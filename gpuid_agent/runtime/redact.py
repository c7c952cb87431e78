"""Credentials inside URLs: what to show instead of them, and which strings to scrub.

`HTTP_ENDPOINT` may carry a user and password (`https://user:pass@host/`) and keys in its
query (`?api_key=…`). Anything that shows the URL (`/status`, `check-config`, logs, errors)
shows `redact_url(url)`; anything that shows text a receiver sent back scrubs
`url_secrets(url)` from it, since receivers like to echo the request they refused.
"""

from __future__ import annotations

import re
from urllib.parse import parse_qsl, unquote, urlsplit

REDACTED = "<redacted>"


def _split(url: str) -> tuple[str, str, str, str, str] | None:
    try:
        parts = urlsplit(url)
    except ValueError:
        return None
    return parts.scheme, parts.netloc, parts.path, parts.query, parts.fragment


def _redact_query(query: str) -> str:
    if not query:
        return query
    out: list[str] = []
    for item in query.split("&"):
        if not item:
            out.append(item)
            continue
        name, sep, _value = item.partition("=")
        out.append(f"{name}={REDACTED}" if sep else REDACTED if _looks_secret(name) else name)
    return "&".join(out)


def _looks_secret(bare: str) -> bool:
    # A bare query item (`?abcd1234`) may itself be a key; only short plain words pass.
    return not (len(bare) <= 16 and bare.replace("-", "").replace("_", "").isalpha())


def redact_url(url: str) -> str:
    """The URL with its userinfo, query values and fragment replaced; never raises.

    Conservative where the URL is odd: an "@" anywhere before the query hides everything from
    the scheme to the last such "@" (a password with a raw "/" splits differently in every
    parser), an authority whose port is not a number is hidden whole, and a URL too broken to
    split is replaced whole.
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
    before_query = re.split(r"[?#]", rest, maxsplit=1)[0]
    if "@" in before_query:
        after = before_query.rpartition("@")[2]
        host, slash, tail = after.partition("/")
        shown = f"{scheme}://{REDACTED}@{host}{slash}{tail}"
    else:
        try:
            urlsplit(url).port  # noqa: B018 - raises for a port that is not a number
        except ValueError:
            netloc = REDACTED
        shown = f"{scheme}://{netloc}{path}"
    if query or "?" in url:
        shown += "?" + _redact_query(query)
    if fragment or "#" in url:
        shown += "#" + (REDACTED if fragment else "")
    return shown


def has_userinfo(url: str) -> bool:
    split = _split(url)
    return split is not None and "@" in split[1]


def url_secrets(url: str) -> list[str]:
    """Strings that must not appear in anything shown: userinfo, query values, fragment,
    each raw and percent-decoded. Longest first, so a secret containing another goes whole."""
    split = _split(url)
    if split is None:
        return [url] if url else []
    scheme, _netloc, _path, query, fragment = split
    found: set[str] = set()
    before_query = re.split(r"[?#]", url.removeprefix(f"{scheme}://"), maxsplit=1)[0]
    if "@" in before_query:
        userinfo = before_query.rpartition("@")[0]
        found.add(userinfo)
        found.update(re.split(r"[:/@]", userinfo))
    for item in query.split("&"):
        name, sep, value = item.partition("=")
        found.add(value if sep else name if _looks_secret(name) else "")
    try:
        decoded = [v for _, v in parse_qsl(query, keep_blank_values=True)]
    except ValueError:
        decoded = []
    found.update(decoded)
    found.add(fragment)
    found.update({unquote(s) for s in found})
    # One-character secrets would blot out every such letter; they are not worth keeping secret
    return sorted((s for s in found if len(s) > 1), key=len, reverse=True)


def scrub(text: str, secrets: list[str] | tuple[str, ...]) -> str:
    """`text` with every secret replaced by the redaction marker."""
    for secret in sorted((s for s in secrets if s), key=len, reverse=True):
        text = text.replace(secret, REDACTED)
    return text
