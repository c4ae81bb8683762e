import hashlib
import pathlib
import re

import numpy as np
import pytest

from nvfp4_jax import data
from nvfp4_jax.config import DataConfig

ASSETS = pathlib.Path(data.__file__).parent.parent / "assets"
SHAKESPEARE = DataConfig(dataset_type="shakespeare")


def _make(cfg=SHAKESPEARE, *, seq_len=32, batch=8, seed=0, split="train", vocab_size=256):
    return data.make_dataset(cfg, seq_len=seq_len, global_batch_size=batch, seed=seed, split=split,
                             vocab_size=vocab_size)


def test_encode_decode_round_trip():
    text = "To be, or not to be — ça va? 東京 🙂\n"
    ids = data.encode(text)
    assert ids.dtype == np.uint8
    assert len(ids) == len(text.encode("utf-8")) > len(text)
    assert data.decode(ids) == text
    assert data.decode(ids.astype(np.int32)) == text
    # A window cut inside a multi-byte character decodes with a replacement, not an exception.
    assert data.decode(ids[:-3]).endswith("\ufffd")
    with pytest.raises(ValueError, match="Byte ids"):
        data.decode([300])


def test_bundled_corpus():
    raw = data.shakespeare_bytes()
    manifest = (ASSETS / "SHAKESPEARE.md").read_text()
    assert hashlib.sha256(raw).hexdigest() in manifest
    assert f"Uncompressed: {len(raw)} bytes" in manifest
    text = raw.decode("utf-8")
    assert "HAMLET:\nTo be, or not to be: that is the question:\n" in text
    assert "JULIET appears above at a window\n\nBut, soft! what light through yonder window" in text
    assert "GLOUCESTER:\nNow is the winter of our discontent" in text
    for markup in ("**", "__", "\\[", "\n#"):
        assert markup not in text, markup
    assert not re.search(r"[ \t]\n", text), "trailing whitespace left"
    assert "\n\n\n" not in text
    assert text.count("\nACT I\n") == 38


def test_batches_are_pure_functions_of_seed_split_step():
    ds = _make()
    a, b = ds.batch(3), _make().batch(3)
    assert set(a) == {"inputs", "targets"}
    assert a["inputs"].shape == a["targets"].shape == (8, 32)
    assert a["inputs"].dtype == a["targets"].dtype == np.int32
    np.testing.assert_array_equal(a["inputs"], b["inputs"])
    assert not np.array_equal(a["inputs"], ds.batch(4)["inputs"])
    assert not np.array_equal(a["inputs"], _make(seed=1).batch(3)["inputs"])


def test_targets_are_the_next_tokens_of_the_raw_stream():
    ds = _make(seq_len=16, batch=4)
    raw = np.frombuffer(data.shakespeare_bytes(), np.uint8)
    starts = ds.offsets(7)
    got = ds.batch(7)
    for row, start in enumerate(starts):
        np.testing.assert_array_equal(got["inputs"][row], raw[start:start + 16])
        np.testing.assert_array_equal(got["targets"][row], raw[start + 1:start + 17])
    # Independently: the text of each input row occurs in the corpus right before its targets' last byte.
    text = data.shakespeare_bytes()
    for row in range(4):
        window = bytes(got["inputs"][row].astype(np.uint8)) + bytes([got["targets"][row, -1]])
        assert window in text


def test_train_and_eval_windows_never_overlap():
    cfg = DataConfig(dataset_type="shakespeare", eval_fraction=0.05)
    train, eval_ = _make(cfg, seq_len=64), _make(cfg, seq_len=64, split="eval")
    total = len(data.shakespeare_bytes())
    assert train.token_range == (0, total - int(total * 0.05))
    assert eval_.token_range == (train.token_range[1], total)
    assert train.num_tokens + eval_.num_tokens == total
    window = 65
    train_last_end = max(int(train.offsets(s).max()) + window for s in range(200))
    eval_first = min(int(eval_.offsets(s).min()) for s in range(200))
    assert train_last_end <= train.token_range[1] <= eval_first
    assert max(int(eval_.offsets(s).max()) + window for s in range(200)) <= total
    assert not np.array_equal(train.batch(0)["inputs"], eval_.batch(0)["inputs"])


def test_windows_reach_both_ends_of_a_split(tmp_path):
    # 20 tokens, half held out: train is [0, 10), so 5-token windows start anywhere in [0, 5].
    path = tmp_path / "ids.bin"
    np.arange(20, dtype=np.uint16).tofile(path)
    cfg = DataConfig(dataset_type="tokens", dataset_path=str(path), eval_fraction=0.5)
    train = _make(cfg, seq_len=4, batch=64)
    starts = np.concatenate([train.offsets(s) for s in range(20)])
    assert starts.min() == 0 and starts.max() == 10 - 5


def test_process_shards_concatenate_to_the_global_batch():
    for cfg in (SHAKESPEARE, DataConfig(dataset_type="synthetic")):
        ds = _make(cfg, batch=8)
        whole = ds.batch(5)
        for count in (2, 4):
            parts = [ds.batch(5, process_index=i, process_count=count) for i in range(count)]
            for key in ("inputs", "targets"):
                assert parts[0][key].shape == (8 // count, 32)
                np.testing.assert_array_equal(np.concatenate([p[key] for p in parts]), whole[key])
        with pytest.raises(data.DataError, match="divisible by process_count=3"):
            ds.batch(5, process_index=0, process_count=3)
        with pytest.raises(data.DataError, match="process_index=2"):
            ds.batch(5, process_index=2, process_count=2)


def test_tokens_file_is_memory_mapped(tmp_path):
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 50_000, size=10_000).astype(np.uint16)
    path = tmp_path / "ids.bin"
    ids.tofile(path)
    cfg = DataConfig(dataset_type="tokens", dataset_path=str(path), token_dtype="uint16", eval_fraction=0.1)
    ds = _make(cfg, seq_len=128, batch=4, vocab_size=50_000)
    assert isinstance(ds.tokens, np.memmap)
    assert ds.token_range == (0, 9_000) and ds.num_tokens == 9_000
    got = ds.batch(2)
    for row, start in enumerate(ds.offsets(2)):
        np.testing.assert_array_equal(got["inputs"][row], ids[start:start + 128])
        np.testing.assert_array_equal(got["targets"][row], ids[start + 1:start + 129])
    assert got["inputs"].max() > 255  # ids wider than a byte survive


def test_text_file_gives_byte_tokens(tmp_path):
    text = "Ünïcödé line\n" * 100
    path = tmp_path / "corpus.txt"
    path.write_text(text, encoding="utf-8")
    ds = _make(DataConfig(dataset_type="text", dataset_path=str(path)), seq_len=16, batch=2)
    raw = data.encode(text)
    got = ds.batch(0)
    for row, start in enumerate(ds.offsets(0)):
        np.testing.assert_array_equal(got["inputs"][row], raw[start:start + 16])


def test_vocab_overflow_is_an_error(tmp_path):
    path = tmp_path / "ids.bin"
    ids = np.arange(1_000, dtype=np.uint16)
    ids[123] = 40_000
    ids.tofile(path)
    cfg = DataConfig(dataset_type="tokens", dataset_path=str(path), eval_fraction=0.1)
    with pytest.raises(data.DataError, match=rf"{re.escape(str(path))}.*token id 40000.*vocab_size=32000"):
        _make(cfg, vocab_size=32_000)
    _make(cfg, vocab_size=40_001)
    # Byte corpora are checked too.
    with pytest.raises(data.DataError, match="vocab_size=100"):
        _make(vocab_size=100)


def test_short_or_missing_files_are_errors(tmp_path):
    path = tmp_path / "ids.bin"
    np.arange(40, dtype=np.uint16).tofile(path)
    cfg = DataConfig(dataset_type="tokens", dataset_path=str(path), eval_fraction=0.1)
    with pytest.raises(data.DataError, match=r"ids.bin: the train split has 36 tokens.*needs at least 65"):
        _make(cfg, seq_len=64)
    _make(cfg, seq_len=8)
    with pytest.raises(data.DataError, match=r"the eval split has 4 tokens.*needs at least 9"):
        _make(cfg, seq_len=8, split="eval")
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    with pytest.raises(data.DataError, match="has 0 tokens"):
        _make(DataConfig(dataset_type="text", dataset_path=str(empty)))
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x00" * 101)
    with pytest.raises(data.DataError, match="not a whole number of uint16"):
        _make(DataConfig(dataset_type="tokens", dataset_path=str(odd)))
    with pytest.raises(data.DataError, match="nope.bin.*does not exist"):
        _make(DataConfig(dataset_type="tokens", dataset_path=str(tmp_path / "nope.bin")))
    with pytest.raises(data.DataError, match="is not a file"):
        _make(DataConfig(dataset_type="text", dataset_path=str(tmp_path)))


@pytest.mark.parametrize("wide", [np.uint32, np.int32])
def test_wide_ids_read_as_uint16_are_warned_about(tmp_path, wide):
    ids = np.random.default_rng(0).integers(0, 5_000, size=4_000).astype(wide)
    path = tmp_path / "ids.bin"
    ids.tofile(path)
    narrow = _make(DataConfig(dataset_type="tokens", dataset_path=str(path), token_dtype="uint16"), vocab_size=5_000)
    # Little-endian: each 32-bit id reads as (id, 0), so every odd 16-bit id is 0.
    assert not narrow.tokens[1::2].any()
    assert len(narrow.warnings) == 1
    assert re.search(r"every odd token id of the first 8,000 is 0.*token_dtype", narrow.warnings[0])
    right = _make(DataConfig(dataset_type="tokens", dataset_path=str(path), token_dtype=np.dtype(wide).name),
                  vocab_size=5_000)
    assert right.warnings == ()


def test_genuine_uint16_ids_are_not_warned_about(tmp_path):
    path = tmp_path / "ids.bin"
    rng = np.random.default_rng(1)
    ids = rng.integers(1, 5_000, size=4_000).astype(np.uint16)
    ids[::7] = 0  # zeros, but not in every other position
    ids.tofile(path)
    assert _make(DataConfig(dataset_type="tokens", dataset_path=str(path)), vocab_size=5_000).warnings == ()
    assert _make().warnings == ()  # byte corpora are never wider ids


def test_synthetic_ids_in_range_and_deterministic():
    cfg = DataConfig(dataset_type="synthetic")
    ds = _make(cfg, seq_len=64, batch=16, vocab_size=1000)
    assert ds.num_tokens is None
    got = ds.batch(0)
    assert got["inputs"].min() >= 0 and got["inputs"].max() < 1000
    assert got["inputs"].max() > 900  # not stuck in a sub-range
    assert len({row.tobytes() for row in got["inputs"]}) == 16  # rows differ
    np.testing.assert_array_equal(got["targets"][:, :-1], got["inputs"][:, 1:])
    again = _make(cfg, seq_len=64, batch=16, vocab_size=1000)
    np.testing.assert_array_equal(got["inputs"], again.batch(0)["inputs"])
    assert not np.array_equal(got["inputs"], ds.batch(1)["inputs"])
    held_out = _make(cfg, seq_len=64, batch=16, vocab_size=1000, split="eval")
    assert not np.array_equal(got["inputs"], held_out.batch(0)["inputs"])
    with pytest.raises(ValueError, match="step must be >= 0"):
        ds.batch(-1)


def test_windows_have_no_epochs_and_every_eval_batch():
    ds = _make()
    assert all(ds.notice(step) is None for step in range(5))
    assert ds.eval_limit(1000) == (1000, None)


def test_the_byte_corpora_need_none_of_the_data_extra():
    import subprocess
    import sys

    # The bundled example runs with the package alone: nothing of the `data` extra is imported.
    code = ("import sys; from nvfp4_jax import data; from nvfp4_jax.config import DataConfig; "
            "data.make_dataset(DataConfig(), seq_len=8, global_batch_size=2, seed=0, split='train', "
            "vocab_size=256).batch(0); data.load_tokenizer('bytes').encode('x', add_eos=True); "
            "extras = ('grain', 'array_record', 'tokenizers', 'sentencepiece', 'tiktoken', 'datasets', 'pyarrow'); "
            "print(sorted({m.split('.')[0] for m in sys.modules} & set(extras)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=str(ASSETS.parent.parent))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
