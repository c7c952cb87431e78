"""The URL redactor and scrubber, with hostile URLs: nothing of the userinfo, the query
values or the fragment survives, whatever characters they hold, and nothing raises."""

from __future__ import annotations

from urllib.parse import quote

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from gpuid_agent.runtime.redact import REDACTED, has_userinfo, redact_url, scrub, url_secrets

# Every secret below interleaves upper-case letters with hostile characters, and nothing
# else in the URL has an upper-case letter: any piece of a secret that leaks shows as one.
HOSTILE = "@:/?#&=%[]\\ \t\n\r\x00;,.+~'\"<>{}|^`!$*()é中\u202e"
_secret_char = st.tuples(
    st.sampled_from("ABCDEFGHJKLMNPQRSTUVWXYZ"), st.text(HOSTILE, max_size=2)
).map("".join)
secret = st.lists(_secret_char, min_size=1, max_size=8).map("".join)
word = st.text("abcdefghijklmnopqrstuvwxyz0123456789-", min_size=1, max_size=10)
host = st.one_of(
    st.lists(word, min_size=1, max_size=3).map(".".join),
    st.just("127.0.0.1"),
    st.just("[::1]"),
)


@st.composite
def hostile_urls(draw: st.DrawFn) -> tuple[str, list[str]]:
    scheme = draw(st.sampled_from(["http", "https"]))
    user = draw(st.one_of(st.none(), secret))
    password = draw(st.one_of(st.none(), secret)) if user is not None else None
    encode = draw(st.booleans())  # a careful operator percent-encodes; a hurried one not

    def enc(text: str) -> str:
        return quote(text, safe="") if encode else text

    userinfo = ""
    if user is not None:
        userinfo = enc(user) + (f":{enc(password)}" if password is not None else "") + "@"
    port = draw(st.one_of(st.just(""), st.integers(1, 65535).map(lambda p: f":{p}")))
    path = "/" + "/".join(draw(st.lists(word, max_size=3)))
    # A raw "&" in a value starts a new parameter for every parser, the receiver's too, and
    # parameter names are shown; so even a hurried operator's value has its "&" encoded.
    params = draw(st.lists(st.tuples(word, secret), max_size=3))
    query = "&".join(f"{name}={enc(value).replace('&', '%26')}" for name, value in params)
    fragment = draw(st.one_of(st.just(""), secret.map(lambda f: "#" + enc(f))))
    url = f"{scheme}://{userinfo}{draw(host)}{port}{path}" + (f"?{query}" if query else "")
    secrets = [s for s in (user, password) if s] + [v for _, v in params]
    return url + fragment, secrets


@given(hostile_urls())
@example(("https://u:SEC/RET@host/x", ["SEC/RET"]))
@example(("https://USER:P?SS@host/", ["USER", "P?SS"]))
@example(("https://U:1?S@host/", ["U", "1?S"]))
@example(("https://A#B@host/", ["A#B"]))
def test_nothing_secret_survives_redaction(case: tuple[str, list[str]]) -> None:
    url, secrets = case
    shown = redact_url(url)
    assert not any(c.isupper() for c in shown), (url, shown)
    # what a receiver might echo: the URL itself, and each secret raw and decoded
    echoed = " | ".join([url, *secrets])
    scrubbed = scrub(echoed, url_secrets(url))
    leftover = scrubbed.replace(REDACTED, "")
    for s in secrets:
        assert s not in leftover, (url, s, scrubbed)


@given(st.text(max_size=300))
def test_any_text_is_handled(text: str) -> None:
    shown = redact_url(text)
    assert isinstance(shown, str)
    assert isinstance(url_secrets(text), list)
    if "@" in text and shown:
        assert shown == REDACTED or REDACTED in shown


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("", ""),
        ("http://127.0.0.1:8080/ingest", "http://127.0.0.1:8080/ingest"),
        (
            "https://user:pass@host.example/x?api_key=abc&b=2",
            f"https://{REDACTED}@host.example/x?api_key={REDACTED}&b={REDACTED}",
        ),
        ("https://host/x?debug", f"https://host/x?{REDACTED}"),
        ("https://host/x#token", f"https://host/x#{REDACTED}"),
        ("https://h:notaport/x", f"https://{REDACTED}/x"),
        ("https://[::1/x", REDACTED),  # too broken to split
        ("HOST/x?k=v", REDACTED),  # no scheme: unsure what is what
    ],
)
def test_known_shapes(url: str, shown: str) -> None:
    assert redact_url(url) == shown


def test_userinfo_detection() -> None:
    assert has_userinfo("https://u:p@h/")
    assert not has_userinfo("https://h/x?mail=a@b")
    assert not has_userinfo("https://[::1/x")
