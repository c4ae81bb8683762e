"""Test-session set-up: CPU only, eight virtual devices for the sharding tests, and one persistent
compilation cache for the session, shared with the processes the tests start (a cached executable
computes the same bits; only the first test to build a program pays for its compile)."""

import atexit
import gc
import os
import shutil
import sys
import tempfile

import pytest

# Must happen before jax is imported anywhere.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache_dir = tempfile.mkdtemp(prefix="nvfp4-jax-test-compilation-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache_dir
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
    atexit.register(shutil.rmtree, _cache_dir, True)


@pytest.fixture(scope="module", autouse=True)
def _release_compiled_programs():
    """Drops JAX's in-memory caches after each test module: a test process (or xdist worker)
    otherwise keeps every executable it compiled, gigabytes by the end of the suite. The
    persistent cache above still serves a later module that builds the same program."""
    yield
    if "jax" in sys.modules:
        sys.modules["jax"].clear_caches()
    gc.collect()


def pytest_collection_modifyitems(config, items):
    """Modules with slow tests run first, each module's tests kept together and in order.
    pytest-xdist's work stealing moves queued tests, never a running one, so a heavy test left
    for the end keeps one worker busy while the other idles; with the heavy modules up front
    the run ends on short tests that stealing can even out."""
    module = lambda item: item.module.__name__ if item.module else item.nodeid
    heavy = {module(i) for i in items if i.get_closest_marker("slow")}
    items.sort(key=lambda i: module(i) not in heavy)  # stable: each module's order is kept
