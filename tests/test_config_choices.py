"""Each choice list is owned once (nvfp4_jax.config.choices or nvfp4_jax.quant.recipe), and the
implementation behind each one handles exactly the choices the list declares: a test here fails
when the list gains a choice its implementation does not run, or the implementation gains a
table entry the list (and so validation) does not offer."""

from __future__ import annotations

import dataclasses
import typing

import numpy as np
import pytest

from nvfp4_jax import config as config_lib
from nvfp4_jax.config import ConfigError, DataConfig, make_config
from nvfp4_jax.config import choices
from nvfp4_jax.quant.recipe import BACKENDS, QUANT_KERNELS


def _literal_fields():
    """(section class, field name, its choices) for every schema field typed with its choices."""
    for cls in (config_lib.ModelConfig, config_lib.DataConfig, config_lib.TrainConfig, config_lib.MeshConfig):
        for name, hint in typing.get_type_hints(cls).items():
            if typing.get_origin(hint) is typing.Literal:
                yield cls, name, typing.get_args(hint)


def test_the_schema_types_its_choice_keys_and_validation_checks_exactly_those_choices():
    fields = {name: options for _, name, options in _literal_fields()}
    assert set(fields) == {
        "attention_quantization", "quantization_backend", "quant_kernels", "attention",
        "context_parallel_strategy", "remat_policy", "dataset_type", "tokenizer_type", "profiler",
        "eval_quantization", "train_params", "model_type"}
    assert fields["attention"] == choices.ATTENTION_KERNELS
    assert fields["quantization_backend"] == BACKENDS and fields["quant_kernels"] == QUANT_KERNELS
    for name, options in fields.items():
        with pytest.raises(ConfigError, match=rf"^{name}='not-a-choice' is not allowed: choose one of "
                                              rf"{__import__('re').escape(str(list(options)))}\.$"):
            make_config({name: "not-a-choice"})


@pytest.mark.parametrize("key", ["attention_quantization", "quantization_backend", "quant_kernels", "attention",
                                 "context_parallel_strategy", "remat_policy", "profiler", "eval_quantization"])
def test_every_declared_choice_makes_a_config(key):
    options = {name: opts for _, name, opts in _literal_fields()}[key]
    for option in options:
        assert getattr(make_config({key: option}).model if hasattr(config_lib.ModelConfig, key)
                       else make_config({key: option}).train, key) == option


def test_choice_values_stay_plain_strings_in_the_saved_config():
    cfg = make_config({"attention": "chunked", "remat_policy": "full"})
    saved = config_lib.to_dict(cfg)
    assert type(saved["model"]["attention"]) is str and config_lib.from_dict(saved) == cfg


def test_attention_runs_every_declared_kernel_and_no_other():
    from nvfp4_jax.model import attention

    assert set(attention.KERNEL_FNS) == set(choices.RESOLVED_ATTENTION_KERNELS)
    assert set(choices.RESOLVED_ATTENTION_KERNELS) | {"autoselected"} | set(choices.ATTENTION_KERNEL_ALIASES) \
        == set(choices.ATTENTION_KERNELS)
    for requested in choices.ATTENTION_KERNELS:
        kernel = attention.select_attention(requested, seq_len=128).kernel
        assert kernel in attention.KERNEL_FNS and callable(attention.attention_fn(kernel, 64))
    with pytest.raises(ValueError, match="attention='flash3' is not allowed"):
        attention.select_attention("flash3")


def test_remat_has_a_policy_for_every_declared_choice_but_none():
    from nvfp4_jax.model import llama

    assert set(llama.REMAT_SAVED_NAMES) | {"none"} == set(choices.REMAT_POLICIES)
    for name in llama.REMAT_SAVED_NAMES:
        llama.remat_policy(name)  # raises for a name without a policy


def test_context_parallelism_wraps_every_declared_strategy_and_no_other():
    from nvfp4_jax.model import ulysses

    assert set(ulysses.STRATEGY_WRAPPERS) == set(choices.CONTEXT_PARALLEL_STRATEGIES)
    for strategy in choices.CONTEXT_PARALLEL_STRATEGIES:
        assert callable(ulysses.context_parallel_attention(lambda q, k, v, **kw: q, strategy))


def test_every_declared_tokenizer_type_has_a_reader_and_no_other():
    from nvfp4_jax.data import tokenizer

    assert set(tokenizer.FILE_TOKENIZERS) | {"bytes"} == set(choices.TOKENIZER_TYPES)
    assert tokenizer.load_tokenizer("bytes").vocab_size > 0


def test_every_declared_dataset_type_opens(tmp_path, monkeypatch):
    from nvfp4_jax.data import streams

    text = tmp_path / "corpus.txt"
    text.write_text("to be or not to be " * 200)
    ids = tmp_path / "ids.bin"
    np.arange(4000, dtype=np.uint16).__mod__(250).astype(np.uint16).tofile(ids)
    for i in range(3):
        np.save(tmp_path / f"image{i}.npy", np.full((8, 8), i, np.uint8))
    examples = tmp_path / "examples.jsonl"
    examples.write_text("".join(f'{{"image": "image{i}.npy", "prompt": "which?", "answer": "{i}"}}\n'
                                for i in range(3)))
    paths = {"text": str(text), "tokens": str(ids), "image_text": str(examples)}
    routed = []
    monkeypatch.setattr(streams, "make_document_batches", lambda data_cfg, **kw: routed.append(data_cfg.dataset_type))
    for kind in choices.DATASET_TYPES:
        data_cfg = dataclasses.replace(DataConfig(), dataset_type=kind, dataset_path=paths.get(kind, ""))
        image_shape = (8, 8, 1) if kind in choices.IMAGE_DATASET_TYPES else None
        batches = streams.make_dataset(data_cfg, seq_len=48, global_batch_size=2, seed=0, split="train",
                                       vocab_size=256, image_shape=image_shape)
        assert (batches is None) == (kind in choices.DOCUMENT_DATASET_TYPES)
    assert routed == list(choices.DOCUMENT_DATASET_TYPES)


def test_every_declared_backend_and_operand_kernel_is_built():
    from nvfp4_jax.kernels import select
    from nvfp4_jax.quant import backends

    assert BACKENDS[0] == "auto"  # resolve_backend's choice; make_backend builds the others
    for name in BACKENDS[1:]:
        assert backends.make_backend(name) is not None
    with pytest.raises(ValueError, match="no backend 'tpu'"):
        backends.make_backend("tpu")
    for choice in QUANT_KERNELS:
        assert select.operand_kernels(choice).name in ("pallas", "jnp")


def test_lora_adapts_every_declared_target_and_no_other():
    import jax

    from nvfp4_jax.config import load_config
    from nvfp4_jax.train import assembly

    cfg = load_config(["model_name=tiny", "base_num_decoder_layers=1", "lora_rank=2", "scan_layers=false"])
    flat = jax.tree_util.tree_flatten_with_path(assembly.assemble(cfg, jax.devices()[:1]).abstract_state.params)[0]
    names = [tuple(k.key for k in path) for path, _ in flat]
    adapted = {n[-2] for n in names if n[-1] == "lora_a"}
    projections = {n[-2] for n in names if n[-1] == "kernel" and len(n) > 2}  # the LM head's kernel is top-level
    assert adapted == set(choices.LORA_TARGETS) == projections
