"""Baton's pytest fixtures for agents' tests (docs/testing.md): installed with Baton,
pytest finds them by itself (the ``pytest11`` entry point).

``baton_registry``: a registry in the test's process on an in-memory store, its staging
root in the test's temporary directory, its clock the test's (``.clock.advance(600)``);
``.client`` is a connected blocking client, ``.async_client()`` an asyncio one,
``.watcher()`` starts a watcher that verifies committed files.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:  # the registry's modules load only when a test asks for the fixture
    from .registry import InProcessRegistry


@pytest.fixture
def baton_registry(tmp_path: Path) -> Iterator[InProcessRegistry]:
    """A registry for this test alone, stopped after it."""
    from .registry import serve

    staging = tmp_path / "baton-staging"
    staging.mkdir()
    with serve(staging) as registry:
        yield registry
