"""The VLM (model/vision.py, model/vlm.py): a bidirectional encoder, a causal decoder over
[image tokens; text], the loss on masked-in targets only, and the vision MLPs through the
project's quantized dot exactly when the vision recipe quantizes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nvfp4_jax import quant
from nvfp4_jax.config import ConfigError, make_config
from nvfp4_jax.model.vision import VisionEncoder, patchify
from nvfp4_jax.train import build

TINY = {"model_type": "vlm", "dataset_type": "digits", "dtype": "float32", "base_emb_dim": 32,
        "base_mlp_dim": 64, "base_num_query_heads": 2, "base_num_kv_heads": 1, "head_dim": 16,
        "base_num_decoder_layers": 1, "max_target_length": 32, "vision_emb_dim": 32, "vision_num_heads": 2,
        "vision_mlp_dim": 64, "vision_num_layers": 1}
B, L = 2, 16  # 16 image tokens + 16 text tokens = max_target_length


def _model(**keys):
    cfg = make_config({**TINY, **keys}).model
    return cfg, build.build_model(cfg)


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.integers(0, 256, (B, L)), jnp.int32),
            jnp.asarray(rng.random((B, 8, 8, 1)), jnp.float32))


def _init(model, tokens):
    return model.init({"params": jax.random.PRNGKey(0), "quant": jax.random.PRNGKey(1)}, tokens)


RNGS = {"quant": jax.random.PRNGKey(2)}


@pytest.fixture(scope="module")
def bf16_model():
    cfg, model = _model()
    tokens, images = _inputs()
    return cfg, model, _init(model, tokens)


def test_patchify_cuts_row_major_squares():
    images = jnp.arange(16, dtype=jnp.float32).reshape(1, 4, 4, 1)
    patches = patchify(images, 2)
    np.testing.assert_array_equal(patches[0, 0], [0, 1, 4, 5])
    np.testing.assert_array_equal(patches[0, 3], [10, 11, 14, 15])


def test_the_encoder_is_bidirectional_the_last_patch_reaches_the_first_token(bf16_model):
    cfg, model, variables = bf16_model
    _, images = _inputs()
    encode = lambda x: model.apply(variables, x, method=lambda m, x: m.vision(x))  # noqa: E731
    changed = images.at[:, 6:, 6:, :].set(1.0 - images[:, 6:, 6:, :])  # the last 2x2 patch only
    before, after = encode(images), encode(changed)
    assert not np.allclose(before[:, 0], after[:, 0])  # the first image token sees the last patch


def test_the_decoder_stays_causal_over_text_and_reads_the_image(bf16_model):
    cfg, model, variables = bf16_model
    tokens, images = _inputs()
    logits = model.apply(variables, tokens, images)
    assert logits.shape == (B, L, cfg.vocab_size)
    later = model.apply(variables, tokens.at[:, -1].set((tokens[:, -1] + 1) % 256), images)
    np.testing.assert_array_equal(logits[:, :-1], later[:, :-1])  # no text position sees a later one
    assert not np.allclose(logits[:, -1], later[:, -1])
    other_image = model.apply(variables, tokens, 1.0 - images)
    assert not np.allclose(logits[:, 0], other_image[:, 0])  # the first text token reads the image


def test_the_loss_counts_only_the_masked_in_targets(bf16_model):
    _, model, variables = bf16_model
    tokens, images = _inputs()
    weights = jnp.zeros((B, L), jnp.float32).at[:, 10:13].set(1.0)  # the "answer" targets

    def loss(targets):
        return model.apply(variables, tokens, targets, method="loss", images_BxSxSxC=images,
                           loss_weights_BxL=weights)

    value, total = loss(tokens)
    assert float(total) == 2 * 3
    prompt_changed, _ = loss(tokens.at[:, 4].set((tokens[:, 4] + 7) % 256))
    answer_changed, _ = loss(tokens.at[:, 11].set((tokens[:, 11] + 7) % 256))
    assert float(prompt_changed) == float(value)
    assert float(answer_changed) != float(value)


def _vision_tokens(model, variables, images):
    return model.apply(variables, images, rngs=RNGS, method=lambda m, x: m.vision(x))


@pytest.mark.parametrize("vision_quantization", ["", "bf16"])
def test_the_vision_mlps_run_the_projects_quantized_dot_exactly_when_their_recipe_quantizes(vision_quantization):
    cfg, model = _model(quantization="te_nvfp4", vision_quantization=vision_quantization)
    tokens, images = _inputs()
    variables = _init(model, tokens)
    vision_params = {"params": variables["params"]["vision"]}
    got = _vision_tokens(model, variables, images)
    bf16 = VisionEncoder(cfg).apply(vision_params, images)
    quantized = VisionEncoder(cfg, mlp_dot_general_cls=quant.dot_general_factory(
        quant.get_recipe("te_nvfp4"), kernel_dtype=cfg.dtype)).apply(vision_params, images, rngs=RNGS)
    assert not np.allclose(quantized, bf16)  # NVFP4 changes the encoder's output
    if vision_quantization == "bf16":  # the decoder stays NVFP4, the vision tower does not
        assert cfg.vision_recipe == quant.get_recipe("bf16")
        np.testing.assert_array_equal(got, bf16)
    else:  # "" follows quantization: the vision MLPs are the project's te_nvfp4 dot, bit for bit
        assert cfg.vision_recipe == quant.get_recipe("te_nvfp4")
        np.testing.assert_array_equal(got, quantized)


def test_the_vision_keys_are_checked_with_one_line_errors():
    with pytest.raises(ConfigError, match=r"^vision_quantization='fp5' is not allowed: choose one of"):
        make_config({**TINY, "vision_quantization": "fp5"})
    with pytest.raises(ConfigError, match=r"^dataset_type='shakespeare' is not allowed: model_type='vlm'"):
        make_config({**TINY, "dataset_type": "shakespeare"})
    with pytest.raises(ConfigError, match=r"^dataset_type='digits' is not allowed: image-text data needs"):
        make_config({"dataset_type": "digits"})
    with pytest.raises(ConfigError, match=r"^patch_size=4 is not allowed: .*4 image tokens to be a multiple of 16"):
        make_config({**TINY, "quantization": "te_nvfp4", "patch_size": 4})
    with pytest.raises(ConfigError, match=r"^max_target_length=16 is not allowed: must exceed the 16 image"):
        make_config({**TINY, "max_target_length": 16})


def test_the_parameter_count_counts_every_vlm_parameter(bf16_model):
    from nvfp4_jax.flops import parameter_count, training_flops_per_step

    cfg, _, variables = bf16_model
    sizes = jax.tree.leaves(jax.tree.map(lambda a: a.size, jax.tree.map(lambda x: x, variables["params"])))
    assert parameter_count(cfg) == sum(sizes)
    text = make_config({k: v for k, v in TINY.items() if k not in ("model_type", "dataset_type")}).model
    # The vision tower adds FLOPs in proportion to the batch's images.
    extra = [training_flops_per_step(cfg, b, 32) - training_flops_per_step(text, b, 32) for b in (1, 2)]
    assert extra[0] > 0 and extra[1] == pytest.approx(2 * extra[0])
