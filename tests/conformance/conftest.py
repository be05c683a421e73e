"""The conformance suite's fixture: one ``baton up`` stack for the whole directory."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from conformance_stack import Stack


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = Stack(tmp_path_factory.mktemp("conformance"))
    try:
        yield s
    finally:
        s.stop()
