"""Published model shapes by `model_name`: applied under the YAML file's and the command line's keys."""

from __future__ import annotations

from typing import Any

# Published shapes. vocab sizes are the real tokenizers'; `tiny` trains in minutes on 2 cores.
# The two CPU-sized presets keep their few small layers unrolled: on 2 CPU cores a scanned step
# was 1.1-1.3x slower (benchmarks/README.md), and their compile time is seconds either way.
MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        vocab_size=256, base_emb_dim=128, base_num_query_heads=4, base_num_kv_heads=2,
        head_dim=32, base_mlp_dim=384, base_num_decoder_layers=4, rope_scaling_factor=1.0,
        scan_layers=False,
    ),
    # About 25M parameters, for the step benchmark.
    "small-25m": dict(
        vocab_size=256, base_emb_dim=512, base_num_query_heads=8, base_num_kv_heads=4,
        head_dim=64, base_mlp_dim=1536, base_num_decoder_layers=8, rope_scaling_factor=1.0,
        scan_layers=False,
    ),
    "llama3-8b": dict(
        vocab_size=128256, base_emb_dim=4096, base_num_query_heads=32, base_num_kv_heads=8,
        head_dim=128, base_mlp_dim=14336, base_num_decoder_layers=32,
        rope_max_timescale=500_000.0, rope_scaling_factor=1.0, normalization_layer_epsilon=1e-5,
    ),
    "llama3.1-405b": dict(
        vocab_size=128256, base_emb_dim=16384, base_num_query_heads=128, base_num_kv_heads=8,
        head_dim=128, base_mlp_dim=53248, base_num_decoder_layers=126,
        rope_max_timescale=500_000.0, rope_scaling_factor=8.0, rope_low_freq_factor=1.0,
        rope_high_freq_factor=4.0, rope_original_max_position=8192,
        normalization_layer_epsilon=1e-5,
    ),
}
