"""Fixtures shared by the core tier."""

import sys

import pytest


@pytest.fixture
def tight_switching():
    """Switch threads every few microseconds so that interleavings actually happen."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    yield
    sys.setswitchinterval(old)
