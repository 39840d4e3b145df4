"""Fixtures shared by the e2e tests that serve the tiny model over HTTP (engine and session server)."""

from __future__ import annotations

import pytest

from miles_async.models import init_model

# Weights drawn wider than init's 0.02, so that greedy output does not repeat one token.
LIVELY_STD = 0.3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return init_model("qwen3", "tiny", tmp_path_factory.mktemp("qwen3"), seed=0, init_std=LIVELY_STD)
