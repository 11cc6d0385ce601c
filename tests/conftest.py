"""Shared fixtures: the default toy build, made once per test session."""

from __future__ import annotations

from pathlib import Path

import pytest

from etagent.config import load_config
from etagent.toy.build import run


@pytest.fixture(scope="session")
def toy(tmp_path_factory) -> Path:
    """The default toy world and tiny model (the one the demo and the later stages use)."""
    out = tmp_path_factory.mktemp("toy")
    run(load_config("toy", "tiny", [f"out_dir={out}"]))
    return out
