"""The model-layout keys are validated like every other key: one clear line per bad value."""

import pytest

from nvfp4_jax.config import ConfigError, ModelConfig, load_config


@pytest.mark.parametrize("arg, pattern", [
    ("attention=flash", r"attention='flash' is not allowed: choose one of \['autoselected', 'dot_product', 'cudnn_flash', 'cudnn_flash_te', 'chunked'\]"),
    ("attention_chunk_size=0", r"attention_chunk_size=0 is not allowed: must be a positive integer \(queries and keys per block of attention=chunked\)"),
    ("remat_policy=save_everything", r"remat_policy='save_everything' is not allowed: choose one of \['none', 'full'"),
    ("num_vocab_tiling=3", r"num_vocab_tiling=3 is not allowed: must be a positive divisor of max_target_length=128"),
    ("num_vocab_tiling=0", r"num_vocab_tiling=0 is not allowed"),
    ("scan_layers=sometimes", r"scan_layers='sometimes': expected a boolean"),
    ("scan_layer=true", r"Unknown config key 'scan_layer'. Did you mean 'scan_layers'\?"),
])
def test_bad_layout_values_are_clear_errors(arg, pattern):
    with pytest.raises(ConfigError, match=pattern):
        load_config(["model_name=tiny", arg])


def test_defaults_and_presets():
    m = ModelConfig()
    assert (m.attention, m.scan_layers, m.remat_policy, m.num_vocab_tiling) == ("autoselected", True, "none", 1)
    assert load_config(["model_name=llama3-8b"]).model.scan_layers
    # The CPU-sized presets unroll their few layers (faster steps on CPU); a key overrides it.
    assert not load_config(["model_name=tiny"]).model.scan_layers
    assert not load_config(["model_name=small-25m"]).model.scan_layers
    assert load_config(["model_name=tiny", "scan_layers=true"]).model.scan_layers
    assert load_config(["attention=cudnn_flash_te"]).model.attention == "cudnn_flash_te"
    assert load_config(["attention=chunked", "attention_chunk_size=256"]).model.attention_chunk_size == 256
