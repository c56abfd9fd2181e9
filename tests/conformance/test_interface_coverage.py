"""Every method of the store interface is called by at least one conformance test.

Runs last (conftest.py moves it there) and checks only when the whole conformance suite
was selected: a single file, a ``-k`` or a ``file::test`` run skips it.
"""

from __future__ import annotations

import pytest

from .conftest import WHOLE
from .interface import required_methods
from .recording import COVERAGE


def test_every_interface_method_is_exercised(request: pytest.FixtureRequest) -> None:
    if not request.config.stash.get(WHOLE, False):
        pytest.skip("only part of the conformance suite was selected")
    required = required_methods()
    assert required, "the store interface declares no methods"
    assert COVERAGE.calls, "no conformance test opened a store"
    missing = COVERAGE.missing(required)
    failed = request.session.testsfailed
    note = f" ({failed} tests failed before this one: they may have stopped short)" if failed else ""
    assert not missing, "interface methods no conformance test calls" + note + ":\n" + "\n".join(
        f"  {backend}: {protocol}.{method}" for backend, methods in missing.items() for protocol, method in methods)
