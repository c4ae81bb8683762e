"""Round trips through `transformers.LlamaForCausalLM` (an independent Llama): the logits of
both models on converted weights agree in fp32, in both directions, with GQA, a head_dim that
is not hidden/heads, and Llama 3.1 RoPE scaling."""

import dataclasses
import os

import jax.numpy as jnp
import numpy as np
import pytest

from _hf_files import HF_CONFIG
from nvfp4_jax.train import params_checkpoint as params_lib
from nvfp4_jax.convert.checkpoints import from_hf, to_hf
from nvfp4_jax.model import Llama

pytestmark = pytest.mark.torch

# Imported by the tests that run, not at collection: transformers takes seconds to import.
torch = transformers = None


@pytest.fixture(autouse=True)
def _libraries():
    global torch, transformers
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")

SEQ = 24  # past rope_scaling's original_max_position_embeddings (16): the scaled band is used
RTOL = 1e-5


def _hf_model(config: dict, seed: int = 0):
    torch.manual_seed(seed)
    fields = {k: v for k, v in config.items() if k not in ("model_type", "architectures")}
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**fields)).eval()
    with torch.no_grad():  # HF initialises norms to exactly 1: make them count
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
    return model


def _tokens(vocab):
    return np.random.default_rng(1).integers(0, vocab, (2, SEQ))


def _hf_logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.double().numpy()


def _our_logits(path, tokens):
    m = params_lib.read_meta(path)["model"]
    from nvfp4_jax.config import make_config

    cfg = dataclasses.replace(make_config(m).model, dtype="float32", max_target_length=SEQ)
    params = params_lib.restore_numpy(path)
    return np.asarray(Llama(cfg).apply({"params": params}, jnp.asarray(tokens)), np.float64)


def _relative(a, b):
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def test_logits_match_transformers_both_ways(tmp_path):
    hf_model = _hf_model(HF_CONFIG)
    hf_model.save_pretrained(str(tmp_path / "hf"))
    tokens = _tokens(HF_CONFIG["vocab_size"])
    reference = _hf_logits(hf_model, tokens)
    # HF -> ours
    from_hf(str(tmp_path / "hf"), str(tmp_path / "ours"), {"scan_layers": "true"})
    ours = _our_logits(str(tmp_path / "ours"), tokens)
    assert _relative(ours, reference) < RTOL
    # ours -> HF: what from_pretrained loads computes our logits
    to_hf(str(tmp_path / "ours"), str(tmp_path / "back"), max_shard_bytes=40_000)
    assert os.path.exists(tmp_path / "back" / "model.safetensors.index.json")
    back = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "back")).eval()
    assert back.config.num_key_value_heads == 2 and back.config.head_dim == 16
    assert back.config.rope_parameters["rope_type"] == "llama3"
    assert _relative(_hf_logits(back, tokens), ours) < RTOL


@pytest.mark.slow
def test_bf16_tied_unrolled_checkpoint_matches_transformers(tmp_path):
    config = {**HF_CONFIG, "tie_word_embeddings": True, "num_key_value_heads": 1}
    _hf_model(config, seed=3).to(torch.bfloat16).save_pretrained(str(tmp_path / "hf"))
    tokens = _tokens(config["vocab_size"])
    # The same bf16 weights computed in fp32 (loaded afresh: `.to(bfloat16)` also rounds the
    # rotary frequencies, a buffer, which the saved checkpoint does not hold).
    fp32 = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32)
    reference = _hf_logits(fp32.eval(), tokens)
    from_hf(str(tmp_path / "hf"), str(tmp_path / "ours"), {"scan_layers": "false"})
    ours = _our_logits(str(tmp_path / "ours"), tokens)
    assert _relative(ours, reference) < RTOL
    to_hf(str(tmp_path / "ours"), str(tmp_path / "back"), dtype="bfloat16")
    back = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "back"))
    assert back.config.tie_word_embeddings is False
    assert next(back.parameters()).dtype == torch.bfloat16
    back = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "back"), dtype=torch.float32)
    assert _relative(_hf_logits(back.eval(), tokens), reference) < RTOL
