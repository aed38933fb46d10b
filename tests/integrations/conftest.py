"""Fixtures of the framework tests: one real shop per module, a customer and a database each."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest

import durably
from durably.demo.shop import ShopService


@pytest.fixture(scope="module")
def shop() -> Iterator[ShopService]:
    with ShopService() as service:
        yield service


@pytest.fixture
def customer() -> str:
    return f"cust-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def db(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path}/durably.db"


@pytest.fixture
def app(db: str) -> Iterator[durably.App]:
    app = durably.App(db, lease_ttl=timedelta(seconds=5))
    yield app
    app.close()
