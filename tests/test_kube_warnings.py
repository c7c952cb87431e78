"""The API server's Warning headers as the agent reads them (RFC 7234 `299 - "text"`, the form
kube-apiserver sends for Warn-mode admission policies and deprecated APIs)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from multidict import CIMultiDict

from gpuid_agent.sources.kube.client import warning_texts


def test_texts_of_kube_apiserver_warnings() -> None:
    headers = CIMultiDict(
        [
            (
                "Warning",
                "299 - \"Validation failed for ValidatingAdmissionPolicy 'p': may only modify its own Node\"",
            ),
            ("Warning", '299 - "a \\"quoted\\" word"'),
            ("Content-Type", "application/json"),
        ]
    )
    assert warning_texts(headers) == [
        "Validation failed for ValidatingAdmissionPolicy 'p': may only modify its own Node",
        'a "quoted" word',
    ]
    assert warning_texts(CIMultiDict()) == []


@given(st.lists(st.text(max_size=2000), max_size=5))
def test_any_header_value_gives_bounded_text(values: list[str]) -> None:
    headers = CIMultiDict([("Warning", v) for v in values])
    texts = warning_texts(headers)
    assert len(texts) == len(values)
    assert all(isinstance(t, str) and len(t) <= 500 for t in texts)
