"""Checkpoints: exact round trip, verified restore with fallback, no non-finite saves, and a kill
inside a save never costs the last good checkpoint."""

import os
import signal

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _helpers import Training, flip_bytes_in_largest_file, train_losses
from nvfp4_jax.train import checkpoint
from nvfp4_jax.train.state import TrainState

# A damaged checkpoint leaves orbax read coroutines behind; they are reported, not raised.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


def _state(step, value, seed=0):
    # Random weights: incompressible, so a flipped byte lands in raw array data.
    w = jax.random.normal(jax.random.PRNGKey(seed), (128, 96), jnp.float32) + value
    return TrainState(
        step=jnp.asarray(step, jnp.int32),
        params={"w": w},
        opt_state=({"mu": -w},),
        fp8_meta={"layer": {"amax_history": jnp.arange(8, dtype=jnp.float32) * value}},
        rng=jax.random.PRNGKey(7),
    )


def _abstract(state):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), state)


def _assert_same(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
        assert x.dtype == y.dtype


def test_round_trip_is_exact_and_verified(tmp_path):
    manager = checkpoint.make_manager(str(tmp_path), max_to_keep=2)
    state = _state(5, 1.25)
    checkpoint.save(manager, state, {"step": 5, "data_step": 5})
    restored, record, verified = checkpoint.restore(manager, _abstract(state))
    assert verified
    assert {k: v for k, v in record.items() if k != "checksums"} == {"step": 5, "data_step": 5}
    assert sorted(record["checksums"]) == ["fp8_meta/layer/amax_history", "opt_state/0/mu", "params/w", "rng", "step"]
    _assert_same(state, restored)


def test_keeps_only_the_newest(tmp_path):
    manager = checkpoint.make_manager(str(tmp_path), max_to_keep=2)
    for step in (1, 2, 3):
        checkpoint.save(manager, _state(step, float(step)), {"step": step})
    assert sorted(manager.all_steps()) == [2, 3]


def test_empty_directory_is_a_clear_error(tmp_path):
    manager = checkpoint.make_manager(str(tmp_path), max_to_keep=2)
    with pytest.raises(checkpoint.CheckpointError, match="No checkpoint"):
        checkpoint.restore(manager, _abstract(_state(0, 0.0)))
    assert checkpoint.restore_newest(manager, _abstract(_state(0, 0.0)), check_record=lambda s, r: None) is None


def test_garbage_files_are_a_clear_error(tmp_path):
    manager = checkpoint.make_manager(str(tmp_path), max_to_keep=2)
    checkpoint.save(manager, _state(1, 1.0), {"step": 1})
    for root, _, files in os.walk(os.path.join(tmp_path, "1", "state")):
        for name in files:
            with open(os.path.join(root, name), "wb") as f:
                f.write(b"garbage")
    with pytest.raises(checkpoint.CheckpointError, match=r"step 1 .*cannot be restored"):
        checkpoint.restore(checkpoint.make_manager(str(tmp_path), max_to_keep=2), _abstract(_state(0, 0.0)))


def test_a_flipped_byte_is_detected_and_the_next_newest_restored(tmp_path):
    manager = checkpoint.make_manager(str(tmp_path), max_to_keep=3)
    for step in (1, 2):
        checkpoint.save(manager, _state(step, float(step), seed=step), {"step": step})
    flip_bytes_in_largest_file(os.path.join(tmp_path, "2", "state"))
    manager = checkpoint.make_manager(str(tmp_path), max_to_keep=3)
    # Where the flip lands decides whether the array decoder notices (an unreadable chunk) or
    # not (other values); either way the restore fails.
    with pytest.raises(checkpoint.CheckpointError,
                       match=r"step 2 .*(checksum mismatch in (params/w|opt_state/0/mu)|cannot be restored)"):
        checkpoint.restore(manager, _abstract(_state(0, 0.0)))

    rejected, records_seen = [], []
    restored = checkpoint.restore_newest(
        manager, _abstract(_state(0, 0.0)), check_record=lambda step, record: records_seen.append(step),
        on_reject=lambda step, why: rejected.append((step, why)),
    )
    assert restored.step == 1 and restored.verified
    assert [s for s, _ in rejected] == [2]
    assert records_seen == [2, 1]  # each record was offered to the config check first
    _assert_same(_state(1, 1.0, seed=1), restored.state)

    with pytest.raises(checkpoint.CheckpointError, match=r"step 2 .*checkpoint_fallback=false"):
        checkpoint.restore_newest(manager, _abstract(_state(0, 0.0)), check_record=lambda s, r: None,
                                  fallback=False)
    # Set aside, the damaged step leaves orbax's folder, which then saves that step again.
    checkpoint.set_aside(manager, 2, str(tmp_path / "rejected"))
    manager = checkpoint.make_manager(str(tmp_path), max_to_keep=3)
    assert manager.all_steps() == [1]
    checkpoint.save(manager, _state(2, 2.0, seed=2), {"step": 2})
    assert checkpoint.restore(manager, _abstract(_state(0, 0.0)))[2]


def test_verify_finds_any_changed_element_and_names_its_leaf(tmp_path):
    manager = checkpoint.make_manager(str(tmp_path), max_to_keep=3)
    state = _state(1, 1.0)
    checkpoint.save(manager, state, {"step": 1})
    _, record, _ = checkpoint.restore(manager, _abstract(state))
    assert checkpoint.verify(state, record)
    w = state.params["w"]
    for index in [(0, 0), (64, 17), (127, 95)]:
        # The smallest change there is: the last bit of one float.
        bits = np.asarray(w).view(np.uint32).copy()
        bits[index] ^= 1
        changed = state.replace(params={"w": jnp.asarray(bits.view(np.float32))})
        with pytest.raises(checkpoint.CheckpointError, match="checksum mismatch in params/w"):
            checkpoint.verify(changed, record)
    # A record without checksums (an older version's) only gets the finiteness check.
    assert checkpoint.verify(state, {"step": 1}) is False
    nan = state.replace(params={"w": w.at[0, 0].set(jnp.nan)})
    with pytest.raises(checkpoint.CheckpointError, match="params/w is not finite"):
        checkpoint.verify(nan, {"step": 1})


@pytest.mark.parametrize("damage", ["truncate", "delete"])
def test_truncated_or_missing_files_fall_back_to_the_next_newest(tmp_path, damage):
    manager = checkpoint.make_manager(str(tmp_path), max_to_keep=3)
    for step in (1, 2):
        checkpoint.save(manager, _state(step, float(step), seed=step), {"step": step})
    files = [os.path.join(r, f) for r, _, names in os.walk(os.path.join(tmp_path, "2", "state")) for f in names]
    largest = max(files, key=os.path.getsize)
    if damage == "truncate":
        os.truncate(largest, os.path.getsize(largest) // 2)
    else:
        os.remove(largest)
    rejected = []
    restored = checkpoint.restore_newest(checkpoint.make_manager(str(tmp_path), max_to_keep=3),
                                         _abstract(_state(0, 0.0)), check_record=lambda s, r: None,
                                         on_reject=lambda step, why: rejected.append(step))
    assert rejected == [2] and restored.step == 1
    _assert_same(_state(1, 1.0, seed=1), restored.state)


def test_every_checkpoint_damaged_is_an_error_listing_them(tmp_path):
    manager = checkpoint.make_manager(str(tmp_path), max_to_keep=3)
    for step in (1, 2):
        checkpoint.save(manager, _state(step, float(step), seed=step), {"step": step})
        flip_bytes_in_largest_file(os.path.join(tmp_path, str(step), "state"))
    with pytest.raises(checkpoint.CheckpointError, match=r"No intact checkpoint .*step 2: .*step 1: "):
        checkpoint.restore_newest(checkpoint.make_manager(str(tmp_path), max_to_keep=3),
                                  _abstract(_state(0, 0.0)), check_record=lambda s, r: None)


def test_a_non_finite_state_is_never_saved(tmp_path):
    manager = checkpoint.make_manager(str(tmp_path), max_to_keep=3)
    checkpoint.save(manager, _state(1, 1.0), {"step": 1})
    bad = _state(2, 2.0)
    bad = bad.replace(opt_state=({"mu": bad.opt_state[0]["mu"].at[3, 4].set(jnp.nan)},))
    with pytest.raises(checkpoint.CheckpointError, match=r"Refusing to save step 2: opt_state/0/mu is not finite"):
        checkpoint.save(manager, bad, {"step": 2})
    assert manager.all_steps() == [1]


def test_orbax_declining_a_step_is_an_error_not_a_silent_skip(tmp_path):
    manager = checkpoint.make_manager(str(tmp_path), max_to_keep=3)
    checkpoint.save(manager, _state(3, 3.0), {"step": 3})
    with pytest.raises(checkpoint.CheckpointError, match=r"did not save step 2.*holds step 3"):
        checkpoint.save(manager, _state(2, 2.0), {"step": 2})


@pytest.mark.slow
def test_kill_inside_a_save_keeps_the_previous_checkpoint_and_resume_continues(tmp_path, reference_losses):
    # The process pauses inside the save of step 4, after writing its arrays, before the commit.
    killed = Training(tmp_path, hold_save_at=4)
    _, step, tmp_dir = killed.wait_for("INSIDE_SAVE").split()
    assert step == "4"
    checkpoints = os.path.join(killed.run_dir, "checkpoints")
    # Proof that it is inside the save: the step's temporary folder holds written array data,
    # the final folder does not exist yet, and the previous checkpoint is committed.
    assert os.path.dirname(tmp_dir) == checkpoints and os.path.basename(tmp_dir).startswith("4.")
    written = [f for root, _, files in os.walk(os.path.join(tmp_dir, "state")) for f in files]
    assert written, "the save had not written its arrays yet"
    assert not os.path.exists(os.path.join(checkpoints, "4"))
    assert os.path.exists(os.path.join(checkpoints, "2", "commit_success.txt"))
    killed.proc.send_signal(signal.SIGKILL)
    assert killed.finish() == -signal.SIGKILL

    resumed = Training(tmp_path)
    assert resumed.finish() == 0, resumed.stderr[-3000:]
    out = "\n".join(resumed.stdout)
    assert "Resumed from checkpoint step 2" in out and "(verified;" in out
    assert "taking over the stale lock" in resumed.stderr  # the killed process never released it
    losses = train_losses(resumed.run_dir)  # also: no step logged twice
    assert sorted(losses) == [1, 2, 3, 4, 5, 6]
    assert losses == reference_losses


def test_a_failed_save_is_one_line_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    import errno

    import orbax.checkpoint as ocp

    manager = checkpoint.make_manager(str(tmp_path), max_to_keep=1)
    first = _state(1, 1.0)
    checkpoint.save(manager, first, {"step": 1}, max_to_keep=1)

    def no_space(self, step, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ocp.CheckpointManager, "save", no_space)
    with pytest.raises(checkpoint.CheckpointError) as err:
        checkpoint.save(manager, _state(2, 2.0), {"step": 2}, max_to_keep=1)
    assert str(err.value) == (f"Saving checkpoint step 2 in {tmp_path} failed (OSError: [Errno 28] No space "
                              "left on device)")
    monkeypatch.undo()
    assert manager.all_steps() == [1]
    restored, _, verified = checkpoint.restore(manager, _abstract(first))
    assert verified
    _assert_same(restored, first)


def test_prune_keeps_only_the_newest_checkpoints(tmp_path):
    manager = checkpoint.make_manager(str(tmp_path), max_to_keep=10)
    for step in (1, 2, 3, 4):
        checkpoint.save(manager, _state(step, float(step)), {"step": step})
    checkpoint.prune(manager, 2)
    assert sorted(manager.all_steps()) == [3, 4]
    assert sorted(n for n in os.listdir(tmp_path) if n.isdigit()) == ["3", "4"]
    checkpoint.save(manager, _state(5, 5.0), {"step": 5}, max_to_keep=1)  # the save rotates too
    assert sorted(n for n in os.listdir(tmp_path) if n.isdigit()) == ["5"]


def test_step_folder_problem_names_a_file_where_a_folder_belongs(tmp_path):
    assert checkpoint.step_folder_problem(str(tmp_path / "absent")) is None
    (tmp_path / "ckpt").write_text("x")
    assert checkpoint.step_folder_problem(str(tmp_path / "ckpt")) == f"{tmp_path / 'ckpt'} is not a directory"
    os.remove(tmp_path / "ckpt")
    (tmp_path / "ckpt" / "2").mkdir(parents=True)
    (tmp_path / "ckpt" / "notes.txt").write_text("x")  # not a step: none of its business
    assert checkpoint.step_folder_problem(str(tmp_path / "ckpt")) is None
    (tmp_path / "ckpt" / "4").write_text("x")
    assert checkpoint.step_folder_problem(str(tmp_path / "ckpt")) == (
        f"{tmp_path / 'ckpt' / '4'} is not a directory (checkpoint step 4 should be)")
