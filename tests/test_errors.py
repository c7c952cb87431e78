"""One exception tree: every exception class the package defines lives in runtime/errors.py,
derives from GpuidError, and is drawn in that module's docstring."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re

import gpuid_agent
from gpuid_agent.runtime import errors


def package_exceptions() -> dict[str, type[BaseException]]:
    found: dict[str, type[BaseException]] = {}
    for info in pkgutil.walk_packages(gpuid_agent.__path__, "gpuid_agent."):
        if "_pb2" in info.name or info.name.endswith("__main__"):
            continue
        module = importlib.import_module(info.name)
        for name, value in vars(module).items():
            if (
                inspect.isclass(value)
                and issubclass(value, BaseException)
                and value.__module__ == module.__name__
            ):
                found[f"{module.__name__}.{name}"] = value
    return found


def test_every_exception_class_lives_in_the_one_tree() -> None:
    found = package_exceptions()
    assert "gpuid_agent.runtime.errors.GpuidError" in found
    outside = sorted(name for name in found if not name.startswith("gpuid_agent.runtime.errors."))
    assert not outside, f"exceptions defined outside runtime/errors.py: {outside}"
    stray = sorted(n for n, cls in found.items() if not issubclass(cls, errors.GpuidError))
    assert not stray, f"exceptions outside the GpuidError tree: {stray}"


def test_the_docstring_draws_every_class_under_its_parent() -> None:
    doc = errors.__doc__ or ""
    # (column of the name, name) for each line of the drawing; the column is the depth
    drawn = re.findall(r"^([\s│├└─]*)([A-Z]\w+Error)\b", doc, re.M)
    names = [name for _, name in drawn]
    classes = {
        name
        for name, value in vars(errors).items()
        if inspect.isclass(value) and issubclass(value, BaseException)
    }
    assert set(names) == classes
    # each drawn class's parent is the nearest class drawn above it, one level shallower
    stack: list[tuple[int, str]] = []
    for indent, name in drawn:
        depth = len(indent)
        while stack and stack[-1][0] >= depth:
            stack.pop()
        if stack:
            assert getattr(errors, name).__bases__[0].__name__ == stack[-1][1], name
        stack.append((depth, name))
