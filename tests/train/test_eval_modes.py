"""eval_quantization: the validation loss through the training recipe's forward pass and through
BF16 with the same weights; quantization_end_step switches evaluation to BF16 too."""

import json
import os

import jax
import types

import numpy as np
import pytest

from _helpers import read_metrics
from nvfp4_jax import data as data_lib
from nvfp4_jax.config import ConfigError, load_config
from nvfp4_jax.quant import quant_rngs
from nvfp4_jax.sharding import make_mesh
from nvfp4_jax.train import checkpoint, loop
from nvfp4_jax.train.build import build_model, state_shardings
from nvfp4_jax.train.evaluation import Evaluation
from nvfp4_jax.train.optimizer import make_optimizer

ONE_DEVICE = jax.devices()[:1]
ARGS = ["model_name=tiny", "base_num_decoder_layers=1", "max_target_length=32", "per_device_batch_size=4",
        "log_period=1", "eval_steps=1", "ici_fsdp_parallelism=1", "eval_interval=1",
        "checkpoint_period=1", "max_checkpoints_to_keep=10", "run_name=run"]


# The loop's evaluation and `_eval_loss` are two programs of the same 1-layer model's loss. The
# run computes in fp32 (`dtype=float32`): with bf16 compute the two programs fuse differently,
# which bf16 roundings XLA keeps depends on the fusions (tests/model/test_layout.py), and one bf16
# ulp moved at an FP4 rounding boundary moves the NVFP4 loss by ~3e-5 (measured when the MLP's
# reshapes changed the fusions). In fp32 their difference is
# reduction order at most (measured: none); 1e-5 relative is 100x a 1-layer model's fp32 noise
# (~1e-7) and ~90x below the FP4 error at evaluation time (measured: 9e-4 of the loss), which
# the test tells apart from BF16 with 20x the tolerance.
SAME_LOSS_RTOL = 1e-5


def _eval_loss(model, state, batch):
    # Independent of the loop's eval step: the model's loss on the held-out batch, jitted alone.
    fn = jax.jit(lambda p, meta, i, t: model.apply({"params": p, **meta}, i, t, method="loss",
                                                   rngs=quant_rngs(state.rng))[0])
    return float(fn(state.params, state.fp8_meta, batch["inputs"], batch["targets"]))


@pytest.fixture(scope="module")
def tail_run(tmp_path_factory):
    """te_nvfp4 for 3 steps, BF16 from step 2 on, evaluated both ways after every step."""
    cfg = load_config(ARGS + [f"base_output_directory={tmp_path_factory.mktemp('eval')}", "quantization=te_nvfp4",
                              "dtype=float32", "steps=3", "quantization_end_step=2", "eval_quantization=both"])
    summary = loop.run(cfg, progress=False, devices=ONE_DEVICE)
    return cfg, summary


@pytest.mark.slow  # three compilations (NVFP4 train and eval, BF16 train and eval) and saves: ~35 s of CPU
def test_bf16_eval_equals_a_plain_bf16_model_on_the_same_weights_and_the_tail_evaluates_in_bf16(tail_run):
    cfg, summary = tail_run
    run_dir = loop.run_directory(cfg)
    evals = {r["step"]: r for r in read_metrics(run_dir) if "eval_loss" in r}
    assert sorted(evals) == [1, 2, 3]
    mesh = make_mesh(cfg.mesh, ONE_DEVICE)
    quantized, plain = build_model(cfg.model), build_model(cfg.model, quantized=False)
    abstract, _ = state_shardings(quantized, make_optimizer(cfg.train), 32, mesh)
    manager = checkpoint.make_manager(os.path.join(run_dir, "checkpoints"), max_to_keep=10)
    held_out = data_lib.make_dataset(cfg.data, seq_len=32, global_batch_size=4, seed=0, split="eval",
                                     vocab_size=256).batch(0)
    for step in (1, 2, 3):
        state = checkpoint.restore(manager, abstract, step)[0]
        bf16 = _eval_loss(plain, state, held_out)
        np.testing.assert_allclose(evals[step]["eval_loss_bf16"], bf16, rtol=SAME_LOSS_RTOL)
        if step == 1:  # still quantizing: the train-recipe evaluation is the NVFP4 forward
            np.testing.assert_allclose(evals[step]["eval_loss"], _eval_loss(quantized, state, held_out),
                                       rtol=SAME_LOSS_RTOL)
            # FP4 error at evaluation time: far beyond the tolerance above.
            assert abs(evals[step]["eval_loss"] - bf16) > 20 * SAME_LOSS_RTOL * bf16
        else:  # from quantization_end_step on, the run trains and evaluates in BF16
            assert evals[step]["eval_loss"] == evals[step]["eval_loss_bf16"]
    manager.close()
    assert summary["final_eval_loss"] == evals[3]["eval_loss"]
    assert summary["final_eval_loss_bf16"] == evals[3]["eval_loss_bf16"]
    assert summary["eval_quantization"] == "both"
    assert [s for s, _ in summary["eval_losses_bf16"]] == [1, 2, 3]
    with open(os.path.join(run_dir, "summary.json")) as f:
        assert json.load(f)["final_eval_loss_bf16"] == summary["final_eval_loss_bf16"]


def test_bad_eval_quantization_names_the_choices():
    with pytest.raises(ConfigError, match=r"eval_quantization.*'train', 'bf16', 'both'"):
        load_config(["eval_quantization=fp4"])


class _Writer:
    def __init__(self):
        self.records = []

    def write(self, record):
        self.records.append(record)


def _evaluation(mode, *, quantized=True, end=-1):
    """The run's evaluations with stand-in eval steps: the quantized one returns 2.5, the BF16 one
    2.0 (the routing is what is tested here; the numbers are the slow test's)."""
    cfg = load_config(ARGS + [f"eval_quantization={mode}", f"quantization_end_step={end}",
                              "quantization=te_nvfp4" if quantized else "quantization=bf16"])
    eval_step = lambda state, batch: np.float32(2.5 if quantized else 2.0)  # noqa: E731
    # The builder's BF16 eval step: a BF16 run's is its own eval step (assembly.Run).
    bf16 = (lambda state, batch: np.float32(2.0)) if quantized else eval_step
    run = types.SimpleNamespace(eval_step=eval_step, bf16_eval_step=bf16, quant_stats_step=None,
                                startup=types.SimpleNamespace(quantizes_anything=quantized))
    return Evaluation(cfg, run, lambda: ["batch"], _Writer(), lambda message: None)


@pytest.mark.parametrize("mode, want", [
    ("train", {"eval_loss": 2.5}),
    ("bf16", {"eval_loss_bf16": 2.0}),
    ("both", {"eval_loss": 2.5, "eval_loss_bf16": 2.0}),
])
def test_eval_quantization_picks_the_forward_passes(mode, want):
    evaluation = _evaluation(mode)
    value = evaluation(10, None)
    (record,) = evaluation.writer.records
    assert {k: v for k, v in record.items() if k.startswith("eval_loss")} == want
    assert value == want.get("eval_loss", want.get("eval_loss_bf16"))
    assert record["eval_perplexity"] == pytest.approx(np.exp(value))


def test_from_quantization_end_step_on_evaluation_is_bf16_too():
    evaluation = _evaluation("both", end=10)
    evaluation(9, None)  # the next step still quantizes
    evaluation(10, None)  # the next step is BF16: so is "the training recipe's" evaluation
    before, after = evaluation.writer.records
    assert (before["eval_loss"], before["eval_loss_bf16"]) == (2.5, 2.0)
    assert (after["eval_loss"], after["eval_loss_bf16"]) == (2.0, 2.0)


def test_a_bf16_run_evaluates_once_for_both():
    evaluation = _evaluation("both", quantized=False)
    evaluation(5, None)
    (record,) = evaluation.writer.records
    assert record["eval_loss"] == record["eval_loss_bf16"] == 2.0
