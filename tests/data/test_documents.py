import os
import re
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
import corpora  # noqa: E402

from nvfp4_jax import data  # noqa: E402
from nvfp4_jax.config import DataConfig  # noqa: E402
from nvfp4_jax.data import packing  # noqa: E402
from nvfp4_jax.data.__main__ import prepare  # noqa: E402

BOS, EOS = 256, 257


def _make(cfg, *, split="train", seq_len=8, batch=2, seed=0, vocab_size=258):
    return data.make_dataset(cfg, seq_len=seq_len, global_batch_size=batch, seed=seed, split=split,
                             vocab_size=vocab_size)


def _corpus(tmp_path, texts, name="docs.parquet"):
    return corpora.write_parquet(tmp_path / name, texts)


def test_eval_rows_are_the_hand_packing_of_the_file_order(tmp_path):
    # Bytes with BOS/EOS: "ab" -> 3 pairs, "cde" -> 4, "f" -> 2. Rows of 8: [3 + 4], [2].
    eval_file = _corpus(tmp_path, ["ab", "cde", "f"], "eval.parquet")
    cfg = DataConfig(dataset_type="grain", grain_train_files=_corpus(tmp_path, ["xyz"] * 4),
                     grain_eval_files=eval_file)
    ds = _make(cfg, split="eval")
    got = ds.batch(0)
    assert set(got) == set(packing.BATCH_KEYS) and all(v.shape == (2, 8) for v in got.values())
    np.testing.assert_array_equal(got["inputs"], [[BOS, 97, 98, BOS, 99, 100, 101, 0], [BOS, 102, 0, 0, 0, 0, 0, 0]])
    np.testing.assert_array_equal(got["targets"], [[97, 98, EOS, 99, 100, 101, EOS, 0], [102, EOS, 0, 0, 0, 0, 0, 0]])
    np.testing.assert_array_equal(got["inputs_segmentation"], [[1, 1, 1, 2, 2, 2, 2, 0], [1, 1, 0, 0, 0, 0, 0, 0]])
    np.testing.assert_array_equal(got["targets_segmentation"], got["inputs_segmentation"])
    np.testing.assert_array_equal(got["inputs_position"], [[0, 1, 2, 0, 1, 2, 3, 0], [0, 1, 0, 0, 0, 0, 0, 0]])
    assert ds.num_batches == 1
    assert ds.describe().endswith("eval: 3 documents, 12 tokens, packed into 2 rows of 8 (56% counted; 1 batch)")
    # Padded instead: one document per row.
    padded = _make(DataConfig(**{**cfg.__dict__, "packing": False}), split="eval", batch=3)
    np.testing.assert_array_equal(padded.batch(0)["inputs"][1], [BOS, 99, 100, 101, 0, 0, 0, 0])
    np.testing.assert_array_equal(padded.batch(0)["targets_segmentation"].sum(axis=1), [3, 4, 2])


def test_an_exhausted_eval_set_is_cut_and_said_so(tmp_path):
    cfg = DataConfig(dataset_type="grain", grain_train_files=_corpus(tmp_path, ["xyz"] * 4),
                     grain_eval_files=_corpus(tmp_path, ["ab", "cde", "f"], "eval.parquet"))
    ds = _make(cfg, split="eval", batch=1)  # 2 rows: 2 batches
    assert ds.eval_limit(2) == (2, None)
    count, line = ds.eval_limit(5)
    assert count == 2 and re.search(r"holds 2 rows: 2 batches of 1, not eval_steps=5", line)
    # A batch past the end is padding only: nothing in it counts.
    assert not ds.batch(7)["targets_segmentation"].any()


def test_train_epochs_visit_every_document_once_reshuffled(tmp_path):
    texts = [f"document number {i}" for i in range(40)]
    cfg = DataConfig(dataset_type="grain", grain_train_files=_corpus(tmp_path, texts), eval_fraction=0.1)
    ds = _make(cfg, seq_len=48, batch=4)
    assert len(ds.docs) == 36 and _make(cfg, split="eval").docs.num_tokens == sum(len(t) + 2 for t in texts[36:])
    tok = data.load_tokenizer("bytes")
    rows_per_epoch = [ds.rows_in_epoch(e) for e in range(3)]
    steps = sum(rows_per_epoch[:2]) // 4
    rows = {k: np.concatenate([ds.batch(s)[k] for s in range(steps + 1)]) for k in packing.BATCH_KEYS}

    def documents(lo, hi):  # the texts of rows [lo, hi)
        out = []
        for r in range(lo, hi):
            for seg in range(1, rows["inputs_segmentation"][r].max() + 1):
                mask = rows["inputs_segmentation"][r] == seg
                out.append(tok.decode(np.append(rows["inputs"][r][mask], rows["targets"][r][mask][-1])))
        return out

    first, second = documents(0, rows_per_epoch[0]), documents(rows_per_epoch[0], sum(rows_per_epoch[:2]))
    assert sorted(first) == sorted(second) == sorted(texts[:36])
    assert first != second  # reshuffled
    assert first != texts[:36]
    # The notice comes with the batch that holds the first row of epoch 2, and only then.
    notices = {s: ds.notice(s) for s in range(steps + 1) if ds.notice(s)}
    starts = [rows_per_epoch[0] // 4, sum(rows_per_epoch[:2]) // 4]
    assert list(notices) == [s for s in starts if s <= steps]
    assert "starts epoch 2" in notices[starts[0]]
    # A corpus smaller than a batch: batch 0 already holds the start of epoch 2, batch 1 may hold more.
    small = _make(DataConfig(dataset_type="grain", grain_train_files=_corpus(tmp_path, texts[:3], "small.parquet")),
                  seq_len=24, batch=4)
    assert small.rows_in_epoch(0) == 2  # 2 train documents of 18 pairs, one per row of 24
    assert re.search(r"batch 0 starts epoch 2 .*seen 1 time;", small.notice(0))
    assert re.search(r"batch 1 starts epochs 3-4 .*seen 3 times", small.notice(1))


def test_batches_are_pure_functions_of_the_step_and_shard_by_process(tmp_path):
    texts = [("word " * (i % 7 + 1)).strip() for i in range(30)]
    cfg = DataConfig(dataset_type="grain", grain_train_files=_corpus(tmp_path, texts))
    ds, fresh = _make(cfg, seq_len=16, batch=4), _make(cfg, seq_len=16, batch=4)
    for step in (0, 5, 13):  # a later step first: a resumed run starts there
        later = fresh.batch(step)
        for k in packing.BATCH_KEYS:
            np.testing.assert_array_equal(later[k], ds.batch(step)[k])
        parts = [ds.batch(step, i, 2) for i in range(2)]
        for k in packing.BATCH_KEYS:
            np.testing.assert_array_equal(np.concatenate([p[k] for p in parts]), later[k])
    assert not np.array_equal(ds.batch(0)["inputs"], _make(cfg, seq_len=16, batch=4, seed=1).batch(0)["inputs"])
    with pytest.raises(data.DataError, match="divisible by process_count=3"):
        ds.batch(0, 0, 3)


def _array_record(tmp_path, texts, **kwargs):
    jsonl = corpora.write_jsonl(tmp_path / "corpus.jsonl", texts)
    prepare([jsonl], str(tmp_path / "prepared"), progress=False, **kwargs)
    return str(tmp_path / "prepared" / "documents.array_record")


def test_array_record_hf_jsonl_and_grain_parquet_give_the_same_batches(tmp_path):
    texts = corpora.TEXTS
    tokenizer = corpora.huggingface_tokenizer(tmp_path)
    keys = dict(tokenizer_type="huggingface", tokenizer_path=tokenizer, grain_eval_files="")
    record = _array_record(tmp_path, texts, tokenizer_path=tokenizer)
    jsonl = str(tmp_path / "corpus.jsonl")
    parquet = _corpus(tmp_path, texts)
    made = [
        _make(DataConfig(dataset_type="grain", grain_train_files=record, **keys), seq_len=32, batch=4, vocab_size=300),
        _make(DataConfig(dataset_type="grain", grain_train_files=parquet, **keys), seq_len=32, batch=4, vocab_size=300),
        _make(DataConfig(dataset_type="hf", hf_train_files=jsonl, tokenizer_type="huggingface",
                         tokenizer_path=tokenizer), seq_len=32, batch=4, vocab_size=300),
    ]
    from tokenizers import Tokenizer

    lib = Tokenizer.from_file(tokenizer)
    first_doc = [lib.token_to_id("<s>"), *lib.encode(texts[0], add_special_tokens=False).ids, lib.token_to_id("</s>")]
    np.testing.assert_array_equal(made[0].docs.read([0])[0], first_doc)
    for step in (0, 3):
        for other in made[1:]:
            for k in packing.BATCH_KEYS:
                np.testing.assert_array_equal(made[0].batch(step)[k], other.batch(step)[k])
    assert made[0].warnings == ()


def test_prepare_records_the_tokenizer_and_training_warns_on_another(tmp_path):
    record = _array_record(tmp_path, corpora.TEXTS)
    meta = data.sources.read_meta(os.path.dirname(record))
    assert meta["documents"] == len(corpora.TEXTS)
    assert meta["tokens"] == sum(len(t.encode()) + 2 for t in corpora.TEXTS)
    assert meta["tokenizer"]["tokenizer_type"] == "bytes"
    other = corpora.huggingface_tokenizer(tmp_path)
    ds = _make(DataConfig(dataset_type="grain", grain_train_files=record, tokenizer_type="huggingface",
                          tokenizer_path=other), vocab_size=300)
    assert len(ds.warnings) == 1 and "prepared with tokenizer_type='bytes'" in ds.warnings[0]


def test_bad_document_inputs_are_data_errors(tmp_path):
    parquet = _corpus(tmp_path, ["some text"] * 4)
    jsonl = corpora.write_jsonl(tmp_path / "c.jsonl", ["some text"] * 4)
    cases = [
        (DataConfig(dataset_type="grain", grain_train_files=str(tmp_path / "none*.array_record")),
         r"grain_train_files='.*none\*.array_record' matches no file"),
        (DataConfig(dataset_type="grain", grain_train_files=parquet, train_data_columns="body"),
         r"docs.parquet has no column 'body' \(train_data_columns\); its columns: \['text', 'n'\]"),
        (DataConfig(dataset_type="hf", hf_train_files=jsonl, train_data_columns="body"),
         r"c.jsonl has no column 'body'"),
        (DataConfig(dataset_type="grain", grain_train_files=f"{parquet},{jsonl}"), r"not a mix"),
        (DataConfig(dataset_type="grain", grain_train_files=parquet, tokenizer_type="sentencepiece",
                    tokenizer_path=str(tmp_path / "nope.model")), r"tokenizer_path='.*nope.model' does not exist"),
    ]
    for cfg, message in cases:
        with pytest.raises(data.DataError, match=message):
            _make(cfg)
    with pytest.raises(data.DataError, match=r"vocab_size=256 is smaller than the tokenizer bytes"):
        _make(DataConfig(dataset_type="grain", grain_train_files=parquet), vocab_size=256)
    one = _corpus(tmp_path, ["only one"], "one.parquet")
    with pytest.raises(data.DataError, match="holds 1 document.*too few to hold one out"):
        _make(DataConfig(dataset_type="grain", grain_train_files=one))


def test_corrupt_or_foreign_array_records_are_data_errors(tmp_path):
    from array_record.python.array_record_module import ArrayRecordWriter

    bad = tmp_path / "bad.array_record"
    bad.write_bytes(os.urandom(70_000))
    with pytest.raises(data.DataError, match=r"bad.array_record is not a readable ArrayRecord file"):
        _make(DataConfig(dataset_type="grain", grain_train_files=str(bad)))
    odd = tmp_path / "odd.array_record"
    writer = ArrayRecordWriter(str(odd), "group_size:1")
    for record in (b"\x01\x00\x00\x00\x02\x00\x00\x00", b"abc"):
        writer.write(record)
    writer.close()
    with pytest.raises(data.DataError, match=r"record 1 has 3 bytes, not int32 token ids"):
        _make(DataConfig(dataset_type="grain", grain_train_files=str(odd)))
    record = _array_record(tmp_path, ["the text of a document"] * 3, tokenizer_path=corpora.huggingface_tokenizer(tmp_path))
    with pytest.raises(data.DataError, match=r"holds token id 2\d\d, but vocab_size=258"):
        _make(DataConfig(dataset_type="grain", grain_train_files=record))  # bytes: 258 ids


def test_each_process_reads_only_the_documents_of_its_rows(tmp_path):
    texts = [f"doc {i} " + "x" * (i % 5) for i in range(24)]
    cfg = DataConfig(dataset_type="grain", grain_train_files=_corpus(tmp_path, texts), packing=False)
    ds = _make(cfg, seq_len=16, batch=4)  # padded: one document per row
    seen = []
    inner = ds.docs.read
    object.__setattr__(ds, "docs", data.sources.Documents(ds.docs.name, ds.docs.lengths,
                                                          lambda idx: (seen.extend(idx), inner(idx))[1],
                                                          ds.docs.max_id))
    mine = ds.batch(3, process_index=1, process_count=2)
    chunks, _ = ds._plan(0)
    assert sorted(seen) == sorted(chunks.doc[14:16].tolist())  # rows 12-15 of step 3; process 1 owns 14, 15
    tok = data.load_tokenizer("bytes")
    assert [tok.decode(r[s > 0]) for r, s in zip(mine["inputs"], mine["inputs_segmentation"])] == \
        [texts[d][:] for d in chunks.doc[14:16]]


def test_tokenizing_threads_change_nothing(tmp_path):
    texts = [f"text {i} " * (i % 9 + 1) for i in range(50)]
    path = _corpus(tmp_path, texts)
    one = _make(DataConfig(dataset_type="grain", grain_train_files=path, grain_worker_count=1), seq_len=32)
    four = _make(DataConfig(dataset_type="grain", grain_train_files=path, grain_worker_count=4), seq_len=32)
    for k in packing.BATCH_KEYS:
        np.testing.assert_array_equal(one.batch(2)[k], four.batch(2)[k])


def test_prepared_files_are_planned_from_their_index_without_reading_records(tmp_path, monkeypatch):
    record = _array_record(tmp_path, corpora.TEXTS)
    assert os.path.isfile(record + ".index.npz")
    cfg = DataConfig(dataset_type="grain", grain_train_files=record)
    reads = []
    real = data.sources._read_records
    monkeypatch.setattr(data.sources, "_read_records", lambda src, idx, where: (reads.append(len(idx)), real(src, idx, where))[1])
    ds = _make(cfg, seq_len=16, batch=2)
    assert reads == [2]  # lengths and largest id came from the index; the probe read 2 records
    reads.clear()
    ds.batch(0)
    assert 0 < sum(reads) <= 2 * 2  # the documents of two rows of 16 pairs: at most two each
    np.testing.assert_array_equal(ds.docs.lengths, [len(t.encode()) + 2 for t in corpora.TEXTS[:len(ds.docs)]])
    # An index that does not match the file is not trusted: the records are read instead. (Each
    # config below differs, as the documents of a config are cached.)
    os.replace(record + ".index.npz", tmp_path / "saved.npz")
    data.sources.write_index(record, np.array([5, 5]), 300)
    reads.clear()
    fresh = _make(DataConfig(dataset_type="grain", grain_train_files=record, eval_fraction=0.2), seq_len=16, batch=2)
    assert sum(reads) == len(corpora.TEXTS) and fresh.docs.max_id == EOS  # the scan's own answer
    # An index whose lengths disagree with the records: at the first or last record of the file
    # at start-up (the probe), elsewhere when a row is built.
    lengths = np.load(tmp_path / "saved.npz")["lengths"]
    data.sources.write_index(record, lengths + 1, 255)
    with pytest.raises(data.DataError, match=r"record 0 has \d+ tokens, but its index says \d+; re-run"):
        _make(DataConfig(dataset_type="grain", grain_train_files=record, eval_fraction=0.3), seq_len=16, batch=2)
    lengths[1:-1] += 1
    data.sources.write_index(record, lengths, 255)
    stale = _make(DataConfig(dataset_type="grain", grain_train_files=record, eval_fraction=0.4), seq_len=16, batch=2)
    with pytest.raises(data.DataError, match=r"has \d+ tokens, but its index says \d+; prepare it again"):
        for step in range(stale.rows_in_epoch() // 2 + 1):  # every row of the epoch
            stale.batch(step)


def test_hf_path_alone_reads_a_local_dataset_folder(tmp_path):
    import datasets

    texts = [f"saved text {i}" for i in range(6)]
    datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(tmp_path / "saved"))
    (tmp_path / "files").mkdir()
    corpora.write_jsonl(tmp_path / "files" / "part.jsonl", texts)
    tok = data.load_tokenizer("bytes")
    for folder in ("saved", "files"):
        ds = _make(DataConfig(dataset_type="hf", hf_path=str(tmp_path / folder), eval_fraction=0.2), split="eval",
                   seq_len=16)
        assert [tok.decode(ds.docs.read([i])[0]) for i in range(len(ds.docs))] == texts[5:]
    datasets.DatasetDict({"test": datasets.Dataset.from_dict({"text": texts})}).save_to_disk(str(tmp_path / "dict"))
    with pytest.raises(data.DataError, match=r"holds the splits \['test'\], not 'train'"):
        _make(DataConfig(dataset_type="hf", hf_path=str(tmp_path / "dict")))
