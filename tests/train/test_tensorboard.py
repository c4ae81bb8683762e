"""TensorBoard scalars: MaxText's tags at each step, and a resume that drops nothing and
duplicates nothing, read back from the event files' protobufs."""

import collections
import os
import struct
import sys

import numpy as np
import pytest

from nvfp4_jax.config import load_config
from nvfp4_jax.train import run_dir as run_dir_lib
from nvfp4_jax.train import tensorboard as tb
from nvfp4_jax.train.optimizer import learning_rate_schedule

pytest.importorskip("tensorboardX")


def _scalars_by_tag_and_step(directory):
    """{(tag, step): [values]}, straight from the protobufs (no TensorBoard semantics)."""
    from tensorboardX.proto import event_pb2

    seen = collections.defaultdict(list)
    for path in sorted(os.path.join(directory, n) for n in os.listdir(directory) if "tfevents" in n):
        data = open(path, "rb").read()
        pos = 0
        while pos + 12 <= len(data):
            (length,) = struct.unpack("<Q", data[pos:pos + 8])
            event = event_pb2.Event.FromString(data[pos + 12:pos + 12 + length])
            for value in event.summary.value:
                seen[(value.tag, event.step)].append(value.simple_value)
            pos += 12 + length + 4
    return seen


def _step(step, loss):
    return {"step": step, "seconds": 0.5, "tflops_per_device": 2.0, "tokens_per_device": 512.0,
            "total_weights": 512.0, "loss": loss, "lm_loss": loss, "perplexity": 1.0, "grad_norm": 0.25}


def _lr(count):
    return 1e-3 * (count + 1)


def test_step_eval_and_quant_records_become_maxtext_scalars(tmp_path):
    board = tb.TensorBoardWriter(str(tmp_path), start=0, learning_rate=_lr)
    board.write(_step(1, 5.0))
    board.write(_step(2, 4.0))
    board.write({"step": 2, "eval_loss": 4.5, "eval_perplexity": 90.0})
    board.write({"step": 2, "quant_stats": {"layers_0/mlp/gate": {"x": {"rel_error": 0.125}}}})
    board.close()
    seen = _scalars_by_tag_and_step(str(tmp_path))
    assert seen[("learning/loss", 1)] == [5.0] and seen[("learning/loss", 2)] == [4.0]
    # step n's update used the schedule at optax's count n - 1
    assert seen[("learning/current_learning_rate", 1)] == [pytest.approx(1e-3)]
    assert seen[("learning/current_learning_rate", 2)] == [pytest.approx(2e-3)]
    assert seen[("learning/grad_norm", 2)] == [0.25]
    assert seen[("perf/step_time_seconds", 2)] == [0.5]
    assert seen[("perf/per_device_tflops_per_sec", 2)] == [2.0]
    assert seen[("perf/per_device_tokens_per_sec", 2)] == [512.0]
    assert seen[("eval/avg_loss", 2)] == [4.5]
    assert seen[("quant_stats/layers_0/mlp/gate/x/rel_error", 2)] == [0.125]
    assert all(len(v) == 1 for v in seen.values())


def test_a_resume_replaces_the_steps_after_its_checkpoint_and_keeps_the_rest(tmp_path):
    first = tb.TensorBoardWriter(str(tmp_path), start=0, learning_rate=_lr)
    for step in range(1, 7):  # a segment that ran to step 6, last checkpoint at step 4
        first.write(_step(step, 10.0 - step))
    first.close()
    path = tb.event_files(str(tmp_path))[0]
    with open(path, "ab") as f:  # killed mid-write: a torn record
        f.write(struct.pack("<Q", 400) + b"\0" * 20)
    second = tb.TensorBoardWriter(str(tmp_path), start=4, learning_rate=_lr)
    assert second.dropped == 2 * len(tb.STEP_TAGS)  # one event per scalar; the torn tail is not one
    for step in (5, 6):
        second.write(_step(step, 100.0 + step))
    second.close()
    seen = _scalars_by_tag_and_step(str(tmp_path))
    losses = {step: values for (tag, step), values in seen.items() if tag == "learning/loss"}
    assert losses == {1: [9.0], 2: [8.0], 3: [7.0], 4: [6.0], 5: [105.0], 6: [106.0]}
    assert all(len(v) == 1 for v in seen.values())
    assert {tag for tag, _ in seen} == set(tb.STEP_TAGS.values())
    assert not [n for n in os.listdir(tmp_path) if "tfevents" not in n]  # no temporary left


def test_without_tensorboardx_the_run_warns_once_and_goes_on(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboardX", None)  # import raises ImportError
    cfg = load_config([f"base_output_directory={tmp_path}"])
    jsonl = run_dir_lib.MetricsWriter(str(tmp_path))
    warnings = []
    assert tb.with_tensorboard(jsonl, cfg, str(tmp_path), 0, warnings.append) is jsonl
    assert len(warnings) == 1 and "pip install 'nvfp4_jax[tensorboard]'" in warnings[0]
    off = load_config([f"base_output_directory={tmp_path}", "enable_tensorboard=false"])
    assert tb.with_tensorboard(jsonl, off, str(tmp_path), 0, warnings.append) is jsonl
    assert len(warnings) == 1
    jsonl.close()


def test_a_repaired_event_file_is_one_note_on_resume_and_an_intact_one_none(tmp_path):
    cfg = load_config([f"base_output_directory={tmp_path}", "steps=10"])
    board_dir = tmp_path / tb.TENSORBOARD_DIR
    first = tb.TensorBoardWriter(str(board_dir), start=0, learning_rate=_lr)
    for step in range(1, 4):
        first.write(_step(step, 10.0 - step))
    first.close()
    notes = []
    tb.with_tensorboard(run_dir_lib.MetricsWriter(str(tmp_path)), cfg, str(tmp_path), 3, notes.append).close()
    assert notes == []
    path = tb.event_files(str(board_dir))[0]  # the first segment's file
    with open(path, "ab") as f:  # killed mid-write: a torn record
        f.write(struct.pack("<Q", 400) + b"\0" * 20)
    tb.with_tensorboard(run_dir_lib.MetricsWriter(str(tmp_path)), cfg, str(tmp_path), 3, notes.append).close()
    assert len(notes) == 1 and notes[0].startswith("note: TensorBoard events")
    assert f"{os.path.basename(path)}: 28 bytes at offset" in notes[0]


def test_the_loop_writes_both_files_with_the_schedules_learning_rate(tmp_path):
    cfg = load_config([f"base_output_directory={tmp_path}", "steps=10", "learning_rate=0.5"])
    jsonl = run_dir_lib.MetricsWriter(str(tmp_path))
    both = tb.with_tensorboard(jsonl, cfg, str(tmp_path), 0, print)
    both.write(_step(3, 2.0))
    both.close()
    assert run_dir_lib.read_metrics(str(tmp_path))[0]["loss"] == 2.0
    assert both.has(3, "loss") and both.segment == 0
    seen = _scalars_by_tag_and_step(str(tmp_path / tb.TENSORBOARD_DIR))
    want = float(learning_rate_schedule(cfg.train)(2))
    # TensorBoard stores float32: exactly the float32 value of what was written (the schedule's).
    assert want > 0 and seen[("learning/current_learning_rate", 3)] == [float(np.float32(want))]


@pytest.mark.slow
def test_a_resumed_run_shows_every_step_once_with_the_losses_of_metrics_jsonl(tmp_path):
    import shutil

    import jax

    from nvfp4_jax.train.loop import run

    args = ["model_name=tiny", "base_num_decoder_layers=1", "max_target_length=32", "per_device_batch_size=2",
            "ici_fsdp_parallelism=1", "eval_steps=1", "eval_interval=2", "checkpoint_period=2",
            f"base_output_directory={tmp_path}", "run_name=run"]
    summary = run(load_config(args + ["steps=4"]), progress=False, devices=jax.devices()[:1])
    run_dir = summary["run_directory"]
    # As if killed after logging step 4 but before its checkpoint was committed.
    shutil.rmtree(os.path.join(run_dir, "checkpoints", "4"))
    summary = run(load_config(args + ["steps=6"]), progress=False, devices=jax.devices()[:1])
    assert summary["resumed_from_step"] == 2
    seen = _scalars_by_tag_and_step(os.path.join(run_dir, tb.TENSORBOARD_DIR))
    assert all(len(values) == 1 for values in seen.values()), [k for k, v in seen.items() if len(v) > 1]
    board = {step: values[0] for (tag, step), values in seen.items() if tag == "learning/loss"}
    jsonl = {r["step"]: r["loss"] for r in run_dir_lib.read_metrics(run_dir) if "loss" in r}
    assert sorted(board) == sorted(jsonl) == [1, 2, 3, 4, 5, 6]
    for step, loss in jsonl.items():
        assert board[step] == float(np.float32(loss))  # TensorBoard stores float32: exactly that
    assert sorted(step for tag, step in seen if tag == "eval/avg_loss") == [2, 4, 6]


def test_damage_in_the_middle_keeps_every_valid_record_before_and_after_it(tmp_path):
    first = tb.TensorBoardWriter(str(tmp_path), start=0, learning_rate=_lr)
    for step in range(1, 7):
        first.write(_step(step, 10.0 - step))
    first.close()
    path = tb.event_files(str(tmp_path))[0]
    records = list(tb._records(path))
    offset = sum(len(r) for r, _ in records[: len(records) // 2])
    with open(path, "r+b") as f:  # one record in the middle damaged
        f.seek(offset + 14)
        f.write(b"\xff\xff")
    second = tb.TensorBoardWriter(str(tmp_path), start=6, learning_rate=_lr)
    second.close()
    assert len(list(tb._records(path))) == len(records) - 1
    # the repair is said, naming the file and where the damage was
    (said,) = second.damaged
    assert said.startswith(os.path.basename(path)) and f"at offset {offset}" in said
    losses = {step for (tag, step) in _scalars_by_tag_and_step(str(tmp_path)) if tag == "learning/loss"}
    assert losses == {1, 2, 3, 4, 5, 6} or len(losses) == 5 and {1, 6} <= losses
