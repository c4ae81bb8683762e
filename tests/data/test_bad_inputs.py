"""Damaged or mis-encoded data files: each is one `error: ...` line (exit 2) naming the file, and
where it can be, the byte, row group or record, before anything compiles.

Fixtures are built here: invalid UTF-8 written as bytes, Parquet pages and ArrayRecord chunks
overwritten in place, indexes and JSON files replaced by garbage."""

import json
import os
import re
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
import corpora  # noqa: E402
from test_train_on_documents import _train_error  # noqa: E402

from nvfp4_jax import data  # noqa: E402
from nvfp4_jax.config import Config, DataConfig  # noqa: E402
from nvfp4_jax.data.__main__ import main as data_main, prepare  # noqa: E402

TEXTS = [f"document number {i} " * 20 for i in range(200)]


def _prepare_error(capsys, *args) -> str:
    """The one stderr line of a `prepare` that must fail with exit code 2."""
    code = data_main(["prepare", *map(str, args)])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


def _make(cfg, vocab_size=258):
    return data.make_dataset(cfg, seq_len=16, global_batch_size=2, seed=0, split="train", vocab_size=vocab_size)


def _bad_utf8_parquet(path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    values = pa.array([b"good text", b"bad \xff text"], pa.binary()).view(pa.string())  # no validation
    pq.write_table(pa.table({"text": values}), str(path))
    return str(path)


def _damaged_parquet(path):
    """Four row groups; the pages of row group 1 overwritten, the footer intact."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": TEXTS}), str(path), row_group_size=50)
    chunk = pq.ParquetFile(str(path)).metadata.row_group(1).column(0)
    start = chunk.dictionary_page_offset or chunk.data_page_offset
    raw = bytearray(path.read_bytes())
    raw[start + 20:start + chunk.total_compressed_size - 20] = b"\xee" * (chunk.total_compressed_size - 40)
    path.write_bytes(bytes(raw))
    return str(path)


# --- 1. invalid UTF-8 ------------------------------------------------------------------------


@pytest.mark.parametrize("name, content, where", [
    ("a.txt", b"caf\xe9 au lait", r"a.txt: byte 3 is not UTF-8 \(it starts b'\\xe9 au'\)"),
    ("a.jsonl", b'{"text": "ok"}\n{"text": "caf\xe9"}\n', r"a.jsonl: byte 28 is not UTF-8"),
])
def test_invalid_utf8_in_text_files_stops_prepare_naming_the_byte(tmp_path, capsys, name, content, where):
    (tmp_path / name).write_bytes(content)
    line = _prepare_error(capsys, "--input", tmp_path / name, "--output", tmp_path / "out")
    assert re.search(where, line) and "text input must be UTF-8" in line, line
    assert not os.path.exists(tmp_path / "out" / "documents.array_record")


def test_invalid_utf8_in_parquet_names_the_row(tmp_path, capsys):
    path = _bad_utf8_parquet(tmp_path / "u.parquet")
    line = _prepare_error(capsys, "--input", path, "--output", tmp_path / "out")
    assert re.search(r"u.parquet row 1 \(column 'text'\): byte 4 is not UTF-8", line), line
    with pytest.raises(data.DataError, match=r"u.parquet row 1 \(column 'text'\): byte 4 is not UTF-8"):
        _make(DataConfig(dataset_type="grain", grain_train_files=path))
    with pytest.raises(data.DataError, match=r"u.parquet: a value of column 'text' is not UTF-8 \(byte 4 of it "
                                             r"starts b'\\xff te'\); text input must be UTF-8"):
        _make(DataConfig(dataset_type="hf", hf_train_files=path))


def test_a_json_escape_that_is_no_text_stops_prepare(tmp_path, capsys):
    (tmp_path / "s.jsonl").write_text('{"text": "fine"}\n{"text": "lone \\udcff"}\n')
    line = _prepare_error(capsys, "--input", tmp_path / "s.jsonl", "--output", tmp_path / "out")
    assert re.search(r"s.jsonl: row 1 of column 'text' holds the lone surrogate '\\udcff' at character 5", line)


def test_invalid_utf8_stops_hf_and_text_training_inputs(tmp_path):
    (tmp_path / "h.jsonl").write_bytes(b'{"text": "ok"}\n{"text": "bad \xff here"}\n' * 3)
    with pytest.raises(data.DataError, match=r"h.jsonl: byte 29 is not UTF-8"):
        _make(DataConfig(dataset_type="hf", hf_train_files=str(tmp_path / "h.jsonl")))
    (tmp_path / "t.txt").write_bytes(b"plain text " * 20 + b"\x80 and more")
    with pytest.raises(data.DataError, match=r"t.txt: byte 220 is not UTF-8"):
        _make(DataConfig(dataset_type="text", dataset_path=str(tmp_path / "t.txt")))


def test_the_streamed_utf8_check_counts_bytes_across_chunks(tmp_path):
    from nvfp4_jax.data.errors import check_utf8_file

    path = tmp_path / "x.txt"
    path.write_bytes("ab€cd".encode() + b"\xc3(")  # € is 3 bytes; chunks of 2 split it
    with pytest.raises(data.DataError, match=r"x.txt: byte 7 is not UTF-8 \(it starts b'\\xc3\('\)"):
        check_utf8_file(str(path), chunk=2)
    path.write_bytes("ab€".encode() + b"\xe2\x82")  # a character cut off by the end of the file
    with pytest.raises(data.DataError, match=r"byte 5 is not UTF-8"):
        check_utf8_file(str(path), chunk=2)
    path.write_bytes("ab€cd€".encode())
    check_utf8_file(str(path), chunk=2)


# --- 2. damaged Parquet pages ----------------------------------------------------------------


def test_damaged_parquet_pages_name_the_file_and_row_group(tmp_path, capsys):
    path = _damaged_parquet(tmp_path / "d.parquet")
    message = r"d.parquet: row group 1 \(of 4\) cannot be read \(.+\); the file is damaged, write it again"
    assert re.search(message, _prepare_error(capsys, "--input", path, "--output", tmp_path / "out"))
    with pytest.raises(data.DataError, match=message):
        _make(DataConfig(dataset_type="grain", grain_train_files=path))


# --- 3. a damaged index of a prepared file ------------------------------------------------


@pytest.fixture
def prepared(tmp_path):
    jsonl = corpora.write_jsonl(tmp_path / "c.jsonl", TEXTS)
    prepare([jsonl], str(tmp_path / "p"), progress=False)
    return str(tmp_path / "p" / "documents.array_record")


@pytest.mark.parametrize("damage", ["garbage", "truncated", "other keys"])
def test_a_damaged_index_says_to_prepare_again(prepared, damage):
    index = prepared + ".index.npz"
    if damage == "garbage":
        with open(index, "wb") as f:
            f.write(os.urandom(500))
    elif damage == "truncated":
        with open(index, "r+b") as f:
            f.truncate(os.path.getsize(index) // 2)
    else:
        np.savez(index, something=np.arange(3))
    with pytest.raises(data.DataError, match=r"documents.array_record.index.npz is damaged \(.+\); re-run "
                                             r"`python -m nvfp4_jax.data prepare ... --overwrite`"):
        _make(DataConfig(dataset_type="grain", grain_train_files=prepared))


# --- 4. corrupt JSON beside a tokenizer or a prepared file --------------------------------


@pytest.fixture
def broken_tokenizer_config(tmp_path):
    tok = corpora.huggingface_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text('{"bos_token": "<s>", ')  # cut off
    return tok


def test_a_corrupt_tokenizer_config_stops_prepare_train_and_sample(tmp_path, capsys, broken_tokenizer_config):
    from nvfp4_jax.sample import run_tokenizer

    message = (r"the tokenizer config .*tokenizer_config.json is not valid JSON \(line 1: Expecting "
               r"property name enclosed in double quotes\); fix it or remove it")
    jsonl = corpora.write_jsonl(tmp_path / "c.jsonl", ["some text"] * 4)
    assert re.search(message, _prepare_error(capsys, "--input", jsonl, "--output", tmp_path / "out",
                                             "--tokenizer", broken_tokenizer_config))
    assert re.search(message, _train_error(tmp_path, capsys, "dataset_type=hf", f"hf_train_files={jsonl}",
                                           "tokenizer_type=huggingface", "vocab_size=512",
                                           f"tokenizer_path={broken_tokenizer_config}"))
    cfg = Config(data=DataConfig(dataset_type="hf", tokenizer_type="huggingface",
                                 tokenizer_path=broken_tokenizer_config))
    with pytest.raises(data.DataError, match=message):
        run_tokenizer(cfg)


def test_a_tokenizer_config_whose_bos_is_no_string_is_named(tmp_path):
    tok = corpora.huggingface_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": ["<s>"]}))
    with pytest.raises(data.DataError, match=r"tokenizer_config.json: bos_token is a list, not a token string"):
        data.load_tokenizer("huggingface", tok)


@pytest.mark.parametrize("content, message", [
    (b'{"tokenizer": ', r"is not valid JSON \(line 1: Expecting value\)"),
    (b'["a list"]', r"holds a JSON list, not an object"),
    (b'{"x": "\xff"}', r"nvfp4_jax_data.json: byte 7 is not UTF-8"),
])
def test_a_corrupt_prepare_manifest_is_named(prepared, content, message):
    with open(os.path.join(os.path.dirname(prepared), "nvfp4_jax_data.json"), "wb") as f:
        f.write(content)
    with pytest.raises(data.DataError, match=r"the manifest of `prepare` .*" + message):
        _make(DataConfig(dataset_type="grain", grain_train_files=prepared))


# --- 5. a damaged ArrayRecord shard --------------------------------------------------------


def test_a_shard_that_disagrees_with_its_index_fails_before_training(prepared):
    index = prepared + ".index.npz"
    with np.load(index) as f:
        lengths, max_id = f["lengths"], f["max_id"]
    np.savez(index, lengths=np.roll(lengths, 1) + 1, max_id=max_id)  # as if another file's index
    with pytest.raises(data.DataError, match=r"documents.array_record: record 0 has \d+ tokens, but its index "
                                             r"says \d+; re-run `python -m nvfp4_jax.data prepare"):
        _make(DataConfig(dataset_type="grain", grain_train_files=prepared))


def _damage_a_middle_record(path: str) -> None:
    """Overwrites bytes inside one record's chunk (not a block header, every 64 KiB)."""
    raw = bytearray(open(path, "rb").read())
    raw[3000:3050] = b"\xee" * 50
    with open(path, "wb") as f:
        f.write(bytes(raw))


def test_a_record_damaged_mid_file_is_a_data_error_when_read(prepared):
    _damage_a_middle_record(prepared)
    ds = _make(DataConfig(dataset_type="grain", grain_train_files=prepared))  # the probe passes
    with pytest.raises(data.DataError, match=r"documents.array_record: cannot read records \(Corrupted "
                                             r"Riegeli/records file: chunk .*hash mismatch"):
        ds.docs.read(list(range(len(ds.docs))))


@pytest.mark.slow
def test_a_record_damaged_mid_file_stops_training_naming_the_last_good_checkpoint(tmp_path, capsys):
    from nvfp4_jax.config import TrainConfig
    from nvfp4_jax.train.__main__ import main as train_main

    jsonl = corpora.write_jsonl(tmp_path / "short.jsonl", [f"document {i}" for i in range(200)])
    prepare([jsonl], str(tmp_path / "p"), progress=False)
    record = str(tmp_path / "p" / "documents.array_record")
    _damage_a_middle_record(record)
    cfg = DataConfig(dataset_type="grain", grain_train_files=record, packing=False)
    ds = data.make_dataset(cfg, seq_len=32, global_batch_size=8, seed=TrainConfig().seed, split="train",
                           vocab_size=258)
    bad_step = 0  # the first batch that reads the damaged record
    while True:
        try:
            ds.batch(bad_step)
        except data.DataError:
            break
        bad_step += 1
    assert 2 <= bad_step < 20, bad_step
    code = train_main(["model_name=tiny", "vocab_size=258", f"base_output_directory={tmp_path / 'runs'}",
                       "dataset_type=grain", f"grain_train_files={record}", "packing=false",
                       "max_target_length=32", "per_device_batch_size=1", f"steps={bad_step + 3}",
                       "checkpoint_period=1", "eval_interval=1000", "enable_tensorboard=false"])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2, last
    assert re.match(rf"error: .*documents.array_record: cannot read records \(Corrupted Riegeli.*\)\. The last "
                    rf"good checkpoint is step {bad_step} in .*\. Fix the data \(re-run `python -m "
                    r"nvfp4_jax.data prepare ... --overwrite`\) and rerun the same command to resume\.$", last), last
