"""HF safetensors <-> our params without transformers: every tensor lands where the layout
says, bit for bit, both ways; config.json maps onto our keys; every bad input is one line."""

import copy
import json
import os

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file

from _hf_files import HF_CONFIG, write_hf_dir
from nvfp4_jax.config import MODEL_PRESETS, ConfigError, make_config
from nvfp4_jax.train import params_checkpoint as params_lib
from nvfp4_jax.convert.__main__ import main
from nvfp4_jax.convert.checkpoints import from_hf, to_hf
from nvfp4_jax.convert.hf import ConvertError, model_keys_from_hf

# Llama 3.1 8B's published config.json (the fields that matter), in the pre-5.x form.
LLAMA31_8B = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096, intermediate_size=14336,
    num_attention_heads=32, num_key_value_heads=8, num_hidden_layers=32, vocab_size=128256,
    rms_norm_eps=1e-5, rope_theta=500000.0, hidden_act="silu", tie_word_embeddings=False,
    attention_bias=False, mlp_bias=False, max_position_embeddings=131072,
    rope_scaling=dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=8192, rope_type="llama3"),
)

# Where HF's per-layer tensors live in our tree, written down from the layout's description
# (the converter's own table is in nvfp4_jax/convert/hf.py).
OURS = {
    "self_attn.q_proj.weight": ("attention", "query", "kernel"),
    "self_attn.k_proj.weight": ("attention", "key", "kernel"),
    "self_attn.v_proj.weight": ("attention", "value", "kernel"),
    "self_attn.o_proj.weight": ("attention", "out", "kernel"),
    "mlp.gate_proj.weight": ("mlp", "gate", "kernel"),
    "mlp.up_proj.weight": ("mlp", "up", "kernel"),
    "mlp.down_proj.weight": ("mlp", "down", "kernel"),
    "input_layernorm.weight": ("attention_norm", "scale"),
    "post_attention_layernorm.weight": ("mlp_norm", "scale"),
}


def _at(tree, *path):
    for key in path:
        tree = tree[key]
    return tree


def test_llama31_8b_config_maps_onto_the_preset_with_its_rope_scaling():
    keys = model_keys_from_hf(LLAMA31_8B)
    preset = MODEL_PRESETS["llama3-8b"]
    for key in ("vocab_size", "base_emb_dim", "base_num_query_heads", "base_num_kv_heads", "head_dim",
                "base_mlp_dim", "base_num_decoder_layers", "rope_max_timescale",
                "normalization_layer_epsilon"):
        assert keys[key] == preset[key], key
    assert (keys["rope_scaling_factor"], keys["rope_low_freq_factor"], keys["rope_high_freq_factor"],
            keys["rope_original_max_position"]) == (8.0, 1.0, 4.0, 8192)
    # transformers 5 writes the same as rope_parameters; Llama 3 (no scaling) has none.
    modern = {k: v for k, v in LLAMA31_8B.items() if k not in ("rope_scaling", "rope_theta")}
    modern["rope_parameters"] = {**LLAMA31_8B["rope_scaling"], "rope_theta": 500000.0}
    assert model_keys_from_hf(modern) == keys
    llama3 = {k: v for k, v in LLAMA31_8B.items() if k != "rope_scaling"}
    assert model_keys_from_hf(llama3)["rope_scaling_factor"] == 1.0


@pytest.mark.parametrize("change, named", [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type='yarn'"),
    ({"attention_bias": True}, "attention_bias=True"),
    ({"mlp_bias": True}, "mlp_bias=True"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"model_type": "mistral"}, "model_type='mistral'"),
    ({"hidden_size": None}, "'hidden_size'"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "'low_freq_factor'"),
])
def test_configs_this_model_cannot_hold_are_refused_by_name(change, named):
    hf = {k: v for k, v in {**LLAMA31_8B, **change}.items() if v is not None}
    with pytest.raises(ConvertError, match=named.replace("[", r"\[")):
        model_keys_from_hf(hf)


def test_from_hf_places_every_tensor_transposed_scanned_and_unrolled(tmp_path):
    hf = write_hf_dir(str(tmp_path / "hf"), dtype="bfloat16", shards=2)
    m = from_hf(str(tmp_path / "hf"), str(tmp_path / "ours"), {"scan_layers": "true", "bf16_first_layers": "1"})
    assert (m.scan_layers, m.bf16_first_layers, m.head_dim, m.base_num_kv_heads) == (True, 1, 16, 2)
    params = params_lib.restore_numpy(str(tmp_path / "ours"))
    assert sorted(params) == ["final_norm", "layers", "layers_0", "lm_head", "token_embedder"]
    f32 = {name: a.astype(np.float32) for name, a in hf.items()}  # bf16 -> fp32 is exact
    np.testing.assert_array_equal(params["token_embedder"]["embedding"], f32["model.embed_tokens.weight"])
    np.testing.assert_array_equal(params["lm_head"]["kernel"], f32["lm_head.weight"].T)
    np.testing.assert_array_equal(params["final_norm"]["scale"], f32["model.norm.weight"])
    for suffix, path in OURS.items():
        hf_0, hf_1, hf_2 = (f32[f"model.layers.{i}.{suffix}"] for i in range(3))
        t = (lambda a: a.T) if path[-1] == "kernel" else (lambda a: a)
        np.testing.assert_array_equal(_at(params, "layers_0", *path), t(hf_0))  # BF16 layer, unrolled
        stacked = _at(params, "layers", *path)  # layers 1 and 2: one scan, stacked
        assert stacked.shape[0] == 2 and stacked.dtype == np.float32
        np.testing.assert_array_equal(stacked[0], t(hf_1))
        np.testing.assert_array_equal(stacked[1], t(hf_2))
    meta = params_lib.read_meta(str(tmp_path / "ours"))["model"]
    assert meta["scan_layers"] is True and meta["base_num_decoder_layers"] == 3


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_to_hf_gives_back_the_same_tensors_sharded_with_an_index(tmp_path, dtype):
    hf = write_hf_dir(str(tmp_path / "hf"))
    from_hf(str(tmp_path / "hf"), str(tmp_path / "ours"), {"scan_layers": "true"})
    out = str(tmp_path / "back")
    to_hf(str(tmp_path / "ours"), out, dtype=dtype, max_shard_bytes=20_000)
    with open(os.path.join(out, "model.safetensors.index.json")) as f:
        weight_map = json.load(f)["weight_map"]
    assert set(weight_map) == set(hf) and len(set(weight_map.values())) > 1
    back = {}
    for file in set(weight_map.values()):
        back.update(load_file(os.path.join(out, file)))
    want = np.float32 if dtype == "float32" else ml_dtypes.bfloat16
    for name, array in hf.items():
        assert back[name].dtype == want, name
        np.testing.assert_array_equal(back[name], array.astype(want), err_msg=name)
    with open(os.path.join(out, "config.json")) as f:
        written = json.load(f)
    assert model_keys_from_hf(written) == model_keys_from_hf(HF_CONFIG)
    assert written["tie_word_embeddings"] is False and written["dtype"] == dtype


def test_tied_embeddings_start_the_lm_head_from_the_table(tmp_path):
    config = {**HF_CONFIG, "tie_word_embeddings": True}
    hf = write_hf_dir(str(tmp_path / "hf"), config)
    assert "lm_head.weight" not in hf
    from_hf(str(tmp_path / "hf"), str(tmp_path / "ours"))
    params = params_lib.restore_numpy(str(tmp_path / "ours"))
    np.testing.assert_array_equal(params["lm_head"]["kernel"], hf["model.embed_tokens.weight"].T)
    assert "layers_2" in params  # the default (tiny preset) layout is unrolled


def test_load_path_must_hold_this_runs_model(tmp_path, hf_dir):
    path, _ = hf_dir
    from_hf(path, str(tmp_path / "ours"), {"scan_layers": "true"})
    keys = model_keys_from_hf(HF_CONFIG)
    ok = make_config(keys, {"scan_layers": True, "max_target_length": 32}).model
    params_lib.check_load_path(str(tmp_path / "ours"), ok)
    for change, named in (({"base_emb_dim": 64}, "base_emb_dim=32 (this run: 64); run with base_emb_dim=32"),
                          ({"scan_layers": False}, "scan_layers=True (this run: False)"),
                          ({"rope_scaling_factor": 1.0}, "rope_scaling_factor=8.0")):
        other = make_config(keys, {"scan_layers": True, **change}).model
        with pytest.raises(ConfigError, match=named.replace("(", r"\(").replace(")", r"\)")) as err:
            params_lib.check_load_path(str(tmp_path / "ours"), other)
        assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="has no params.json"):
        params_lib.check_load_path(str(tmp_path), ok)
    with pytest.raises(ConfigError, match="does not exist"):
        params_lib.check_load_path(str(tmp_path / "nowhere"), ok)


def _break(tmp_path, how):
    """An HF folder damaged in one way; returns its path."""
    path = str(tmp_path / "hf")
    config = copy.deepcopy(HF_CONFIG)
    if how == "wrong shape":
        config["intermediate_size"] = 40
        write_hf_dir(path)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(config, f)
        return path
    write_hf_dir(path, shards=2 if how == "missing shard" else 1)
    if how == "no config":
        os.remove(os.path.join(path, "config.json"))
    elif how == "bad json":
        with open(os.path.join(path, "config.json"), "w") as f:
            f.write("{not json")
    elif how == "no safetensors":
        os.remove(os.path.join(path, "model.safetensors"))
    elif how == "missing shard":
        os.remove(os.path.join(path, "model-00002-of-00002.safetensors"))
    elif how in ("missing tensor", "extra tensor", "damaged file"):
        tensors = load_file(os.path.join(path, "model.safetensors"))
        if how == "missing tensor":
            del tensors["model.layers.1.mlp.up_proj.weight"]
        else:
            tensors["model.layers.0.self_attn.q_proj.bias"] = np.zeros(64, np.float32)
        from safetensors.numpy import save_file

        save_file(tensors, os.path.join(path, "model.safetensors"))
        if how == "damaged file":
            with open(os.path.join(path, "model.safetensors"), "r+b") as f:
                f.write(b"\xff" * 16)
    return path


@pytest.mark.parametrize("how, named", [
    ("no config", "config.json' does not exist"),
    ("bad json", "is not valid JSON"),
    ("no safetensors", "holds no *.safetensors"),
    ("missing shard", "names 'model-00002-of-00002.safetensors', which is missing"),
    ("missing tensor", "'model.layers.1.mlp.up_proj.weight' is missing"),
    ("extra tensor", "'model.layers.0.self_attn.q_proj.bias'"),
    ("wrong shape", "'model.layers.0.mlp.gate_proj.weight' has shape [48, 32] but config.json implies [40, 32]"),
    ("damaged file", "is not a readable safetensors file"),
])
def test_every_bad_hf_folder_is_one_line_and_exit_2(tmp_path, capsys, how, named):
    path = _break(tmp_path, how)
    out = str(tmp_path / "out")
    assert main(["from-hf", path, out]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and named in err, err
    assert not os.path.exists(out)  # nothing written before the inputs are known good


@pytest.mark.parametrize("args, named", [
    (["from-hf", "{tmp}/nowhere", "{tmp}/out"], "is not a directory"),
    (["from-hf", "{hf}", "{tmp}/out", "base_emb_dim=64"], "from-hf takes only model_name"),
    (["from-hf", "{hf}", "{tmp}/out", "scan_layers=maybe"], "scan_layers='maybe': expected a boolean"),
    (["from-hf", "{hf}", "{tmp}/out", "bf16_first_layers=9"], "bf16_first_layers"),
    (["from-hf", "{hf}", "{hf}"], "already exists and is not an empty directory"),
    (["from-hf", "{hf}"], "from-hf needs HF_DIR OUT"),
    (["to-hf", "{tmp}/nowhere", "{tmp}/out"], "does not exist"),
    (["to-hf", "{hf}", "{tmp}/out"], "is neither a run directory"),
    (["to-hf", "{tmp}", "{tmp}/out", "--dtype", "float16"], "--dtype='float16' is not allowed"),
    (["to-hf", "{tmp}", "{tmp}/out", "--shards"], "Unknown option '--shards'"),
    (["to-hf", "{tmp}", "{tmp}/out", "--max-shard-bytes", "lots"], "must be a positive whole number"),
    (["export", "{hf}"], "Unknown command 'export'"),
    ([], "No command; choose from-hf or to-hf"),
])
def test_every_bad_command_line_is_one_line_and_exit_2(tmp_path, capsys, hf_dir, args, named):
    args = [a.format(tmp=tmp_path, hf=hf_dir[0]) for a in args]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and named in err, err


_PEAK_RSS = """
import sys
from nvfp4_jax.convert.checkpoints import from_hf
import jax, orbax.checkpoint, safetensors  # their own memory is not the conversion's

def peak_mib():
    return int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0]) / 1024

before = peak_mib()
from_hf(sys.argv[1], sys.argv[2], {"scan_layers": "true"})
print(peak_mib() - before)
"""


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads the peak RSS from /proc")
def test_from_hf_needs_less_host_memory_than_the_converted_weights(tmp_path):
    import subprocess
    import sys

    config = dict(HF_CONFIG, vocab_size=8192, hidden_size=1024, intermediate_size=4096,
                  num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8, head_dim=128)
    hf = write_hf_dir(str(tmp_path / "hf"), config, dtype="bfloat16", shards=3)
    weights_mib = sum(a.size for a in hf.values()) * 4 / 2**20  # fp32, as converted
    del hf
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", _PEAK_RSS, str(tmp_path / "hf"), str(tmp_path / "ours")],
                         capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=repo), check=True)
    growth_mib = float(out.stdout.split()[-1])
    assert growth_mib < weights_mib, (growth_mib, weights_mib)


@pytest.mark.parametrize("overrides", [
    {"model_name": "tiny"},
    {"model_name": "tiny", "scan_layers": True, "bf16_first_layers": 1, "bf16_last_layers": 1},
    {"model_name": "llama3-8b"},
])
def test_the_map_covers_exactly_the_models_parameters(overrides):
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    from nvfp4_jax.convert.hf import param_shapes
    from nvfp4_jax.model import Llama

    m = make_config(overrides).model
    tokens = jnp.zeros((1, 8), jnp.int32)
    boxed = jax.eval_shape(lambda: Llama(m).init(jax.random.PRNGKey(0), tokens))["params"]
    flat = jax.tree_util.tree_flatten_with_path(nn.meta.unbox(boxed))[0]
    model = {tuple(k.key for k in path): leaf.shape for path, leaf in flat}
    assert model == param_shapes(m)
