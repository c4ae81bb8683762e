"""A checkpoint holds one layer layout; restoring it into the other is named, not an orbax dump."""

import jax

from nvfp4_jax.config import load_config
from nvfp4_jax.sharding import make_mesh
from nvfp4_jax.train import checkpoint
from nvfp4_jax.train.build import build_model, init_state, layout_mismatch
from nvfp4_jax.train.optimizer import make_optimizer

BASE = ["model_name=tiny", "base_num_decoder_layers=2", "max_target_length=32", "ici_fsdp_parallelism=1"]


def test_a_scanned_checkpoint_is_named_as_such_when_restored_unrolled(tmp_path):
    scanned = load_config(BASE + ["scan_layers=true"])
    model, optimizer = build_model(scanned.model), make_optimizer(scanned.train)
    state, _ = init_state(model, optimizer, 32, make_mesh(scanned.mesh, jax.devices()[:1]), 0)
    manager = checkpoint.make_manager(str(tmp_path), max_to_keep=1)
    checkpoint.save(manager, state, {"step": 0})
    saved = manager.item_metadata(0)["state"]["params"].keys()

    assert layout_mismatch(scanned.model, saved) is None
    message = layout_mismatch(load_config(BASE + ["scan_layers=false"]).model, saved)
    assert message.startswith("The checkpoint holds the scan_layers=True layout (decoder parameters stacked")
    assert "this run has scan_layers=False: resume with scan_layers=True" in message


def test_unrolled_names_and_unrelated_trees():
    unrolled = ["token_embedder", "layers_0", "layers_1", "final_norm", "lm_head"]
    message = layout_mismatch(load_config(BASE + ["scan_layers=true"]).model, unrolled)
    assert "holds the scan_layers=False layout (decoder parameters in layers_0, layers_1, ...)" in message
    # A tree that is neither layout (another depth, another model) is left to the restore.
    assert layout_mismatch(load_config(BASE + ["scan_layers=true"]).model, unrolled[:2] + unrolled[3:]) is None
    # With BF16 edges the scanned layout keeps them unrolled around `layers`.
    edges = load_config(BASE + ["scan_layers=true", "base_num_decoder_layers=3", "bf16_first_layers=1"]).model
    assert layout_mismatch(edges, ["token_embedder", "layers_0", "layers", "final_norm", "lm_head"]) is None
