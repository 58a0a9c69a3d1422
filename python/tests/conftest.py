from __future__ import annotations

import pytest
from fabric import Agent, Etcd


@pytest.fixture
def agent():
    a = Agent()
    yield a
    a.kill()


@pytest.fixture
def etcd():
    e = Etcd()
    yield e
    e.stop()
