"""Checkpoints: exact round trip, and a kill mid-save never costs the last good checkpoint."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nvfp4_jax.train import checkpoint
from nvfp4_jax.train.state import TrainState


def _state(step, value):
    return TrainState(
        step=jnp.asarray(step, jnp.int32),
        params={"w": jnp.full((64, 32), value, jnp.float32)},
        opt_state=({"mu": jnp.full((64, 32), -value, jnp.float32)},),
        fp8_meta={"layer": {"amax_history": jnp.arange(8, dtype=jnp.float32) * value}},
        rng=jax.random.PRNGKey(7),
    )


def test_round_trip_is_exact(tmp_path):
    manager = checkpoint.make_manager(str(tmp_path), max_to_keep=2)
    state = _state(5, 1.25)
    checkpoint.save(manager, state, {"step": 5, "data_step": 5})
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), state)
    restored, record = checkpoint.restore(manager, abstract)
    assert record == {"step": 5, "data_step": 5}
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(restored)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert a.dtype == b.dtype


def test_keeps_only_the_newest(tmp_path):
    manager = checkpoint.make_manager(str(tmp_path), max_to_keep=2)
    for step in (1, 2, 3):
        checkpoint.save(manager, _state(step, float(step)), {"step": step})
    assert sorted(manager.all_steps()) == [2, 3]


def test_empty_directory_is_a_clear_error(tmp_path):
    manager = checkpoint.make_manager(str(tmp_path), max_to_keep=2)
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), _state(0, 0.0))
    with pytest.raises(checkpoint.CheckpointError, match="No checkpoint"):
        checkpoint.restore(manager, abstract)


def test_corrupt_checkpoint_is_a_clear_error(tmp_path):
    manager = checkpoint.make_manager(str(tmp_path), max_to_keep=2)
    checkpoint.save(manager, _state(1, 1.0), {"step": 1})
    # Damage every data file of the saved state.
    for root, _, files in os.walk(os.path.join(tmp_path, "1", "state")):
        for name in files:
            with open(os.path.join(root, name), "wb") as f:
                f.write(b"garbage")
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), _state(0, 0.0))
    with pytest.raises(checkpoint.CheckpointError, match=r"step 1 .*cannot be restored"):
        checkpoint.restore(checkpoint.make_manager(str(tmp_path), max_to_keep=2), abstract)


_SAVER = textwrap.dedent(
    """
    import sys, jax, jax.numpy as jnp
    from nvfp4_jax.train import checkpoint
    from nvfp4_jax.train.state import TrainState
    manager = checkpoint.make_manager(sys.argv[1], max_to_keep=100)
    step = (manager.latest_step() or 0) + 1
    while True:
        big = jnp.full((1024, 1024), float(step), jnp.float32)
        state = TrainState(step=jnp.asarray(step, jnp.int32), params={"w": big, "v": big + 1},
                           opt_state=(), fp8_meta={}, rng=jax.random.PRNGKey(0))
        checkpoint.save(manager, state, {"step": step})
        print(step, flush=True)
        step += 1
    """
)


@pytest.mark.slow
def test_kill_during_save_leaves_a_restorable_latest(tmp_path):
    directory = str(tmp_path / "ckpt")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    for delay in (4.0, 5.3, 6.1):
        proc = subprocess.Popen([sys.executable, "-c", _SAVER, directory], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        manager = checkpoint.make_manager(directory, max_to_keep=100)
        latest = manager.latest_step()
        assert latest is not None
        abstract = TrainState(
            step=jax.ShapeDtypeStruct((), jnp.int32),
            params={"w": jax.ShapeDtypeStruct((1024, 1024), jnp.float32),
                    "v": jax.ShapeDtypeStruct((1024, 1024), jnp.float32)},
            opt_state=(), fp8_meta={}, rng=jax.ShapeDtypeStruct((2,), jnp.uint32),
        )
        state, record = checkpoint.restore(manager, abstract)
        assert record["step"] == latest == int(state.step)
        assert float(state.params["w"][0, 0]) == latest
        assert float(state.params["v"][-1, -1]) == latest + 1
