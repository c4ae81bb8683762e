"""Fixtures shared by the tests that run the training command as a process (see _helpers.py)."""

import os

import pytest

import _helpers
from _helpers import Training, train_losses


@pytest.fixture(scope="session", autouse=True)
def shared_compilation_cache():
    _helpers.COMPILATION_CACHE["dir"] = os.environ["JAX_COMPILATION_CACHE_DIR"]  # tests/conftest.py
    return _helpers.COMPILATION_CACHE["dir"]


@pytest.fixture(scope="session")
def reference_losses(tmp_path_factory):
    """{step: loss} of the uninterrupted `CLI_ARGS` run."""
    out = tmp_path_factory.mktemp("reference")
    run = Training(out)
    assert run.finish() == 0, run.stderr[-3000:]
    losses = train_losses(run.run_dir)
    assert sorted(losses) == [1, 2, 3, 4, 5, 6]
    return losses
