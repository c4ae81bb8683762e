import pytest

from nvfp4_jax.config import ConfigError, DataConfig, make_config, to_dict
from nvfp4_jax.train.resume import RESUME_MUTABLE_KEYS, config_differences


def test_document_keys_default_to_maxtexts():
    d = DataConfig()
    assert (d.tokenizer_type, d.add_bos, d.add_eos, d.packing, d.train_data_columns) == ("bytes", True, True, True, "text")
    cfg = make_config({"dataset_type": "hf", "hf_train_files": "a.jsonl", "packing": "false", "add_bos": "0"})
    assert cfg.data.packing is False and cfg.data.add_bos is False


@pytest.mark.parametrize("args, message", [
    ({"tokenizer_type": "gpt2"}, r"tokenizer_type='gpt2' is not allowed: choose one of \['bytes', 'huggingface', "
                                 r"'sentencepiece', 'tiktoken'\]"),
    ({"tokenizer_type": "sentencepiece"}, r"tokenizer_path='' is not allowed: tokenizer_type='sentencepiece' needs"),
    ({"dataset_type": "grain"}, r"grain_train_files='' is not allowed: dataset_type='grain' needs local files"),
    ({"dataset_type": "hf"}, r"hf_train_files='' is not allowed"),
    ({"dataset_type": "arrow"}, r"dataset_type='arrow' is not allowed: choose one of .*'grain', 'hf'"),
    ({"tokenizer_type": "tiktoken", "tokenizer_path": "t.tiktoken"},
     r"tokenizer_type='tiktoken' is not allowed: dataset_type='shakespeare' is byte tokens"),
    ({"grain_worker_count": -1}, r"grain_worker_count=-1 is not allowed: must be >= 0"),
    ({"train_data_columns": "a,b"}, r"train_data_columns='a,b' is not allowed: one column name"),
    ({"tokeniser_type": "bytes"}, r"Did you mean 'tokenizer_type'"),
])
def test_bad_document_keys_fail_in_the_config(args, message):
    with pytest.raises(ConfigError, match=message):
        make_config(args)


def test_only_the_worker_count_may_change_on_resume():
    base = make_config({"dataset_type": "grain", "grain_train_files": "a.array_record"})
    assert "grain_worker_count" in RESUME_MUTABLE_KEYS
    assert config_differences(to_dict(base), make_config({**_flat(base), "grain_worker_count": 4})) == []
    changed = make_config({**_flat(base), "packing": False})
    assert [key for key, _, _ in config_differences(to_dict(base), changed)] == ["packing"]


def _flat(cfg):
    return {f"{section}.{k}": v for section, keys in to_dict(cfg).items() for k, v in keys.items()}
