"""The run names its quantization backend at start-up, records it in each checkpoint, and resumes
across backends exactly where the state trees agree."""

import os

import jax
import pytest

from nvfp4_jax.config import ConfigError, load_config
from nvfp4_jax.quant import BackendChoice
from nvfp4_jax.train import checkpoint
from nvfp4_jax.train.resume import check_backend as check_backend_resume
from nvfp4_jax.train.loop import run

TINY = [
    "model_name=tiny", "base_num_decoder_layers=1", "max_target_length=32", "per_device_batch_size=2",
    "log_period=1", "eval_steps=1", "eval_interval=1000", "ici_fsdp_parallelism=1",
    "quantization=te_fp8_delayedscaling", "checkpoint_period=2", "run_name=run",
]


@pytest.mark.slow
def test_backend_is_named_recorded_and_checked_on_resume(tmp_path, capsys):
    base = TINY + [f"base_output_directory={tmp_path}"]
    run(load_config(base + ["steps=2"]), progress=False, devices=jax.devices()[:1])
    out = capsys.readouterr().out
    assert "quantization backend: emulated (auto: te_fp8_delayedscaling is fp8" in out

    manager = checkpoint.make_manager(os.path.join(tmp_path, "run", "checkpoints"), max_to_keep=3)
    record = checkpoint.read_record(manager, 2)
    assert record["quantization_backend"] == "emulated"
    model_cfg = load_config(base).model
    # TE keeps delayed-scaling state in another collection: that resume must fail, clearly.
    with pytest.raises(ConfigError, match="written with quantization_backend=emulated and this run uses te"):
        check_backend_resume(record, BackendChoice("te", "test"), model_cfg)
    check_backend_resume(record, BackendChoice("xla", "test"), model_cfg)  # same tree: fine

    # Naming the backend explicitly on resume (auto -> emulated) continues the run.
    summary = run(load_config(base + ["steps=3", "quantization_backend=emulated"]), progress=False,
                  devices=jax.devices()[:1])
    assert "Resumed from checkpoint step 2" in capsys.readouterr().out
    assert summary["last_checkpoint_step"] == 3
