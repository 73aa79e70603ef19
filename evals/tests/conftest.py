"""Fixtures for the eval-suite tests: the tiny engine, loaded once per session."""

from __future__ import annotations

import pytest

from .tiny import tiny_engine


@pytest.fixture(scope="session")
def tiny():
    return tiny_engine()
