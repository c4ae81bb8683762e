"""The VLM through the one builder (`assembly.assemble`) and the trainer: its parameters sharded
by the same logical-axis table as the decoder's, and a short run of the vlm-tiny preset whose
held-out VQA accuracy (summary.json) beats the best constant answer's."""

import json
import os

import jax
import pytest

from nvfp4_jax.config import load_config
from nvfp4_jax.train import assembly, loop

PRESET = os.path.join(os.path.dirname(__file__), "..", "..", "recipes", "configs", "vlm-tiny.yml")


def test_assemble_builds_the_vlm_sharded_by_the_decoders_table():
    cfg = load_config([PRESET, "ici_fsdp_parallelism=2", "per_device_batch_size=2"])
    run = assembly.assemble(cfg, jax.devices()[:2])
    params = run.abstract_state.params
    assert set(params) == {"vision", "projector", "decoder"}
    vision_gate = params["vision"]["layers_0"]["mlp"]["gate"]["kernel"].sharding.spec
    decoder = params["decoder"]
    decoder_gate = (decoder["layers"] if "layers" in decoder else decoder["layers_0"])["mlp"]["gate"]["kernel"]
    spec = tuple(decoder_gate.sharding.spec)[-2:]  # scanned: [N, D, F]
    assert tuple(vision_gate) == spec and vision_gate[0] is not None  # embed over fsdp, as the decoder's
    batch = run.dataset("train").batch(0)
    assert batch["inputs"].shape == (4, cfg.model.text_length) and batch["images"].shape == (4, 8, 8, 1)


@pytest.mark.slow
def test_a_short_vlm_run_answers_held_out_questions_better_than_chance(tmp_path):
    cfg = load_config([PRESET, "steps=200", "eval_interval=200", "enable_checkpointing=false",
                       "enable_tensorboard=false", f"base_output_directory={tmp_path}"])
    summary = loop.run(cfg, progress=False, devices=jax.devices()[:1])
    with open(os.path.join(summary["run_directory"], "summary.json")) as f:
        written = json.load(f)
    assert written["vqa_questions"] == summary["vqa_questions"] > 1000
    assert 0.2 < written["vqa_chance"] < 0.5
    assert written["vqa_accuracy"] > written["vqa_chance"] + 0.1, written
    assert set(written["vqa_accuracy_by_type"]) == {"digit", "parity", "greater", "caption"}
    assert written["vqa_chance_by_type"]["digit"] < 0.15  # ten digits, about evenly many
