"""Keep the load snapshots of pre-built servers as fresh as each test means them to be."""

import pytest

from tests.unit.builders import restamp


@pytest.fixture(autouse=True)
def _fresh_snapshots():
    restamp()
