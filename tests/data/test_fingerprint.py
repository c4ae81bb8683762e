"""The data fingerprint a checkpoint records: every change of a data or tokenizer file changes it
and `compare` names the file and how; a resume on changed files stops with one line (exit 2)
unless allow_data_change=true, and a checkpoint without a fingerprint resumes with a note."""

import json
import os
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "train"))
import corpora  # noqa: E402

from nvfp4_jax.config import DataConfig, load_config  # noqa: E402
from nvfp4_jax.data import DataError, fingerprint as fp  # noqa: E402
from nvfp4_jax.data.__main__ import prepare  # noqa: E402
from nvfp4_jax.train import resume  # noqa: E402


def _text_cfg(path, **extra):
    return DataConfig(dataset_type="text", dataset_path=str(path), **extra)


def _flip_byte(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 1]))


def test_one_changed_byte_is_a_content_change_naming_the_file(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_bytes(b"To be, or not to be: that is the question. " * 40)
    before = fp.fingerprint(_text_cfg(path))
    assert before["files"] == [{"role": "train data", "path": str(path), "size": 1720, "tokens": 1720,
                                "sha256": before["files"][0]["sha256"], "digest_of": fp.WHOLE}]
    assert fp.compare(before, fp.fingerprint(_text_cfg(path))) == []
    _flip_byte(path, 1000)
    assert fp.compare(before, fp.fingerprint(_text_cfg(path))) == [
        f"train data {path}: content changed (same size, 1,720 bytes; the sha256 of its whole file differs)"]


def test_an_appended_byte_is_a_size_change_with_the_token_counts(tmp_path):
    path = tmp_path / "ids.bin"
    path.write_bytes(bytes(4000))
    cfg = DataConfig(dataset_type="tokens", dataset_path=str(path), token_dtype="uint16")
    before = fp.fingerprint(cfg)
    assert before["files"][0]["tokens"] == 2000
    with open(path, "ab") as f:
        f.write(bytes(2))
    assert fp.compare(before, fp.fingerprint(cfg)) == [
        f"train data {path}: size 4,000 -> 4,002 bytes, tokens 2,000 -> 2,001"]


def test_a_large_file_is_sampled_and_still_sees_a_change_inside_a_block_and_any_change_of_size(tmp_path, monkeypatch):
    monkeypatch.setattr(fp, "WHOLE_FILE_LIMIT", 1 << 16)  # so that a small file counts as large
    path = tmp_path / "big.txt"
    path.write_bytes(os.urandom(fp.SAMPLE_BYTES * fp.SAMPLE_BLOCKS * 2))
    before = fp.fingerprint(_text_cfg(path))
    assert before["files"][0]["digest_of"] == fp.SAMPLED
    _flip_byte(path, 0)  # the first block is always sampled, and so is the last
    [change] = fp.compare(before, fp.fingerprint(_text_cfg(path)))
    assert change.startswith(f"train data {path}: content changed") and fp.SAMPLED in change
    _flip_byte(path, 0)
    assert fp.compare(before, fp.fingerprint(_text_cfg(path))) == []
    with open(path, "ab") as f:
        f.write(b"x")
    assert fp.compare(before, fp.fingerprint(_text_cfg(path)))[0].startswith(f"train data {path}: size ")


def test_a_sampled_digest_reads_a_bounded_amount(tmp_path, monkeypatch):
    monkeypatch.setattr(fp, "WHOLE_FILE_LIMIT", 1 << 16)
    path = tmp_path / "sparse.bin"
    with open(path, "wb") as f:
        f.truncate(64 << 30)  # 64 GiB, sparse: hashing it whole would take minutes
    start = time.perf_counter()
    assert fp.digest(str(path))["size"] == 64 << 30
    assert time.perf_counter() - start < 2


def test_the_bundled_corpus_costs_well_under_a_second():
    start = time.perf_counter()
    record = fp.fingerprint(DataConfig())
    assert time.perf_counter() - start < 0.5
    assert record["tokenizer"] == fp.BYTES_IDENTITY
    assert [f["path"] for f in record["files"]] == ["nvfp4_jax/assets/shakespeare.txt.xz"]  # not where installed
    assert fp.fingerprint(DataConfig(dataset_type="synthetic"))["files"] == []


def test_swapping_the_tokenizer_changes_the_fingerprint(tmp_path):
    corpus = corpora.write_jsonl(tmp_path / "c.jsonl", corpora.TEXTS)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first = corpora.huggingface_tokenizer(tmp_path / "a")
    other = tmp_path / "b" / "tokenizer.json"
    text = json.loads(open(first).read())
    text["added_tokens"][0]["content"] = "<UNK>"
    other.write_text(json.dumps(text))
    cfg = DataConfig(dataset_type="hf", hf_train_files=corpus, tokenizer_type="huggingface",
                     tokenizer_path=str(tmp_path / "a"))  # a folder: its tokenizer.json is read
    before = fp.fingerprint(cfg)
    assert [(f["role"], f["path"]) for f in before["files"]] == [("train data", corpus), ("tokenizer", first)]
    os.replace(other, first)  # another tokenizer at the same path
    [change] = fp.compare(before, fp.fingerprint(cfg))
    assert change.startswith(f"tokenizer {first}: ")
    # A tokenizer_config.json beside it is read too (BOS/EOS): adding one is a change.
    config = tmp_path / "a" / "tokenizer_config.json"
    config.write_text('{"bos_token": "<s>"}')
    assert f"tokenizer {config}: read now" in " ".join(fp.compare(before, fp.fingerprint(cfg)))
    # From bytes to a file tokenizer: named as such.
    assert fp.compare(fp.fingerprint(DataConfig(dataset_type="hf", hf_train_files=corpus)), before)[0] == (
        f"tokenizer {fp.BYTES_IDENTITY!r} -> 'huggingface'")


def test_globs_cover_exactly_the_files_the_loader_reads_and_their_indexes(tmp_path):
    data = tmp_path / "data"
    prepare([corpora.write_jsonl(tmp_path / "c.jsonl", corpora.TEXTS)], str(data), progress=False)
    record = str(data / "documents.array_record")
    cfg = DataConfig(dataset_type="grain", grain_train_files=str(data / "*.array_record"))
    before = fp.fingerprint(cfg)
    entries = {f["path"]: f for f in before["files"]}
    assert list(entries) == [record, record + ".index.npz"]  # not nvfp4_jax_data.json: never read
    assert entries[record]["documents"] == len(corpora.TEXTS)
    assert entries[record]["tokens"] > 0
    # A new file that the glob now matches, and one that is gone, are both named.
    os.rename(record, str(data / "renamed.array_record"))
    os.rename(record + ".index.npz", str(data / "renamed.array_record.index.npz"))
    diffs = fp.compare(before, fp.fingerprint(cfg))
    assert f"train data {data / 'renamed.array_record'}: read now" in diffs[0]
    assert diffs[-1].startswith(f"train data {record}.index.npz: not read any more")
    assert len(diffs) == 4
    with pytest.raises(DataError, match="matches no file"):
        fp.fingerprint(DataConfig(dataset_type="grain", grain_train_files=str(tmp_path / "none*.array_record")))


def test_a_parquet_file_counts_its_rows(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = str(tmp_path / "c.parquet")
    pq.write_table(pa.table({"text": corpora.TEXTS}), path)
    [entry] = fp.fingerprint(DataConfig(dataset_type="grain", grain_train_files=path))["files"]
    assert entry["documents"] == len(corpora.TEXTS) and entry["size"] == os.path.getsize(path)


def test_an_hf_folder_is_every_file_in_it(tmp_path):
    folder = tmp_path / "ds"
    (folder / "part").mkdir(parents=True)
    corpora.write_jsonl(folder / "part" / "b.jsonl", corpora.TEXTS)
    corpora.write_jsonl(folder / "a.jsonl", corpora.TEXTS)
    record = fp.fingerprint(DataConfig(dataset_type="hf", hf_path=str(folder)))
    assert [f["path"] for f in record["files"]] == [str(folder / "a.jsonl"), str(folder / "part" / "b.jsonl")]


def test_check_data_stops_notes_or_passes(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_bytes(b"a" * 1000)
    cfg = _text_cfg(path)
    saved = {"data_fingerprint": fp.fingerprint(cfg)}
    assert resume.check_data(4, saved, fp.fingerprint(cfg), allow_change=False, run_dir="runs/r") is None
    path.write_bytes(b"b" * 1000)
    now = fp.fingerprint(cfg)
    with pytest.raises(resume.ResumeError) as err:
        resume.check_data(4, saved, now, allow_change=False, run_dir="runs/r")
    message = str(err.value)
    assert message.startswith("runs/r holds checkpoint step 4, trained on other data than this run would read: "
                              f"train data {path}: content changed")
    assert "allow_data_change=true" in message and "\n" not in message
    note = resume.check_data(4, saved, now, allow_change=True, run_dir="runs/r")
    assert note.startswith("note: allow_data_change=true: resuming checkpoint step 4") and str(path) in note
    older = resume.check_data(4, {"config": {}}, now, allow_change=False, run_dir="runs/r")
    assert older.startswith("note: checkpoint step 4 records no data fingerprint")


def test_allow_data_change_is_a_data_key_that_may_change_on_resume():
    assert DataConfig().allow_data_change is False
    cfg = load_config(["allow_data_change=true"])
    assert cfg.data.allow_data_change is True
    assert resume.config_differences(resume.to_dict(load_config([])), cfg) == []


@pytest.mark.slow
def test_a_resume_on_a_changed_corpus_stops_in_one_line_unless_allowed(tmp_path, monkeypatch):
    import _helpers

    monkeypatch.setitem(_helpers.COMPILATION_CACHE, "dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
    corpus = tmp_path / "corpus.txt"
    text = " ".join(corpora.TEXTS) * 3
    corpus.write_text(text)
    data = ["dataset_type=text", f"dataset_path={corpus}"]
    first = _helpers.Training(tmp_path, "steps=2", *data)
    assert first.finish() == 0, first.stderr[-3000:]

    corpus.write_text(text[::-1])  # another corpus of the same size at the same path
    again = _helpers.Training(tmp_path, "steps=4", *data)
    assert again.finish() == 2, again.stderr[-3000:]
    lines = again.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"error: {first.run_dir} holds checkpoint step 2, trained on other data")
    assert f"train data {corpus}: content changed (same size, " in lines[0]
    assert not any(line.startswith("Resumed") for line in again.stdout)

    allowed = _helpers.Training(tmp_path, "steps=4", *data, "allow_data_change=true")
    assert allowed.finish() == 0, allowed.stderr[-3000:]
    notes = [line for line in allowed.stdout if line.startswith("note: allow_data_change=true")]
    assert len(notes) == 1 and f"train data {corpus}: content changed" in notes[0]
    # Its checkpoints record the corpus it read: the plain command resumes from them, silently.
    plain = _helpers.Training(tmp_path, "steps=5", *data)
    assert plain.finish() == 0, plain.stderr[-3000:]
    assert any(line.startswith("Resumed from checkpoint step 4") for line in plain.stdout)
    assert not any(line.startswith("note:") for line in plain.stdout)
