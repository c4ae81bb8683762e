"""quant_stats=true: the statistics step, the loop's records, and nothing changed when it is off."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tolerance import error_statistic_rtol

from nvfp4_jax.config import load_config
from nvfp4_jax.quant import health
from nvfp4_jax.train import assembly
from nvfp4_jax.train.loop import run
from nvfp4_jax.train.step import make_eval_step, make_train_step

SMALL = ["model_name=tiny", "base_num_decoder_layers=2", "max_target_length=32", "ici_fsdp_parallelism=1"]
ONE_DEVICE = jax.devices()[:1]
BATCH = {"inputs": jax.ShapeDtypeStruct((2, 32), jnp.int32), "targets": jax.ShapeDtypeStruct((2, 32), jnp.int32)}


def _steps_jaxprs(*args):
    """The jaxprs of the train and eval steps the loop builds for this config."""
    parts = assembly.assemble(load_config(SMALL + list(args)), ONE_DEVICE)
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), parts.abstract_state)
    return [str(jax.make_jaxpr(step)(abstract, BATCH))
            for step in (make_train_step(parts.model, parts.optimizer), make_eval_step(parts.model))]


@pytest.fixture
def stats_code_raises(monkeypatch):
    """Every statistics function raises when traced: proves whether a step runs any of them."""
    def boom(*args, **kwargs):
        raise AssertionError("quantization statistics were computed")

    for name in ("nvfp4_stats", "mxfp4_stats", "fp8_stats", "value_stats"):
        monkeypatch.setattr(health, name, boom)


@pytest.mark.slow
@pytest.mark.parametrize("flag", ["te_nvfp4", "mxfp4", "te_fp8_delayedscaling"])
def test_train_and_eval_steps_never_compute_statistics(flag, stats_code_raises):
    # Traced with every statistics function booby-trapped: the steps contain none of them, with
    # the flag on or off, and are the same programs either way.
    off = _steps_jaxprs(f"quantization={flag}", "quant_stats=false")
    on = _steps_jaxprs(f"quantization={flag}", "quant_stats=true")
    assert off == on
    # The trap works: the statistics step does run them.
    parts = assembly.assemble(load_config(SMALL + [f"quantization={flag}"]), ONE_DEVICE)
    with pytest.raises(AssertionError, match="statistics were computed"):
        jax.eval_shape(parts.quant_stats_step, parts.abstract_state, BATCH)


@pytest.mark.slow
def test_stats_step_measures_each_quantized_projection_and_its_weight():
    parts = assembly.assemble(load_config(SMALL + ["quantization=te_nvfp4", "bf16_first_layers=1"]), ONE_DEVICE)
    state = parts.init_state(seed=0)
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 33), 0, 256)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    stats = health.flatten(jax.device_get(parts.quant_stats_step(state, batch)))
    # Layer 0 runs in BF16: only layer 1's three MLP projections are measured.
    assert sorted(stats) == [f"layers_1/mlp/{p}" for p in ("down", "gate", "up")]
    for proj, operands in stats.items():
        assert set(operands) == {"x", "w", "dy", "x_wgrad", "dy_wgrad"}
        kernel = state.params["layers_1"]["mlp"][proj.split("/")[-1]]["kernel"]
        # The dot quantizes the kernel in the compute dtype (bf16), as MaxText + TE do.
        want = jax.jit(lambda k: health.nvfp4_stats(k.astype(jnp.bfloat16), axis=0, two_d=True))(kernel)
        for name, value in want.items():
            # Counts and amax exact; the error's sums fused differently in the two programs.
            if name == "error":
                np.testing.assert_allclose(operands["w"][name], float(value), err_msg=f"{proj} {name}",
                                           rtol=2 * error_statistic_rtol(kernel.size))
            else:
                assert operands["w"][name] == float(value), f"{proj} {name}"
        for op, values in operands.items():
            assert 0.0 < values["error"] < 0.5 and values["amax"] > 0, (proj, op, values)


@pytest.mark.slow
def test_loop_writes_statistics_at_evaluations_while_it_quantizes(tmp_path):
    cfg = load_config(SMALL + [
        "quantization=te_nvfp4", "bf16_first_layers=1", "steps=3", "eval_interval=1", "eval_steps=1",
        "quantization_end_step=2", "enable_checkpointing=false", "quant_stats=true",
        f"base_output_directory={tmp_path}", "run_name=run"])
    run(cfg, progress=False, devices=ONE_DEVICE)
    with open(os.path.join(tmp_path, "run", "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    assert [r["step"] for r in records if "eval_loss" in r] == [1, 2, 3]
    measured = [r for r in records if "quant_stats" in r]
    # From step 2 on the run trains in BF16 and has nothing to measure.
    assert [r["step"] for r in measured] == [1]
    assert sorted(measured[0]["quant_stats"]) == [f"layers_1/mlp/{p}" for p in ("down", "gate", "up")]


@pytest.mark.slow
def test_scanned_layers_give_each_layer_its_own_statistics():
    """Under scan_layers=true the statistics come back stacked per layer; split by `flatten`, each
    layer's weight statistics are those of the unrolled model (same initial weights)."""
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 33), 0, 256)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    by_layout = {}
    for scan in (False, True):
        parts = assembly.assemble(load_config(SMALL + ["quantization=te_nvfp4", f"scan_layers={str(scan).lower()}"]),
                                  ONE_DEVICE)
        by_layout[scan] = health.flatten(jax.device_get(parts.quant_stats_step(parts.init_state(seed=0), batch)))
    projections = ("down", "gate", "up")
    assert sorted(by_layout[True]) == sorted(f"layers/mlp/{p}[{i}]" for p in projections for i in (0, 1))
    for i in (0, 1):
        for p in projections:
            assert by_layout[True][f"layers/mlp/{p}[{i}]"]["w"] == by_layout[False][f"layers_{i}/mlp/{p}"]["w"]
