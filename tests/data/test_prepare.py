import os
import re
import subprocess
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
import corpora  # noqa: E402

from nvfp4_jax.data import load_tokenizer  # noqa: E402
from nvfp4_jax.data.__main__ import main, tokenizer_type_for  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_prepare_writes_one_record_of_ids_per_document(tmp_path):
    import grain.python as gp

    corpora.write_jsonl(tmp_path / "a.jsonl", ["first doc", "", "second"])
    corpora.write_parquet(tmp_path / "b.parquet", ["third one"])
    (tmp_path / "c.txt").write_text("a whole file\nis one document\n")
    tok_path = corpora.sentencepiece_model(tmp_path)
    out = subprocess.run(
        [sys.executable, "-m", "nvfp4_jax.data", "prepare", "--tokenizer", tok_path, "--no-bos",
         "--input", str(tmp_path / "*.jsonl"), "--input", f"{tmp_path}/b.parquet,{tmp_path}/c.txt",
         "--output", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=120, cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO))
    assert out.returncode == 0, out.stderr
    tok = load_tokenizer("sentencepiece", tok_path)
    # The empty JSONL text still has its EOS: 1 token, nothing to predict, skipped.
    docs = [tok.encode(t, add_eos=True) for t in ["first doc", "second", "third one", "a whole file\\nis one document\\n"
                                                  .replace("\\n", "\n")]]
    assert re.search(rf"prepared 4 documents, {sum(map(len, docs))} tokens .*1 empty skipped.* from 3 file\(s\) "
                     r"with tokenizer sentencepiece \(400 ids\)", out.stdout)
    assert "tokenizer_type=sentencepiece" in out.stdout and "vocab_size=400" in out.stdout
    source = gp.ArrayRecordDataSource([str(tmp_path / "out" / "documents.array_record")])
    assert len(source) == 4
    for i, expected in enumerate(docs):
        np.testing.assert_array_equal(np.frombuffer(source[i], "<i4"), expected)


def test_tokenizer_type_follows_the_file_name(tmp_path):
    assert tokenizer_type_for("") == "bytes"
    assert tokenizer_type_for("x/tokenizer.json") == "huggingface"
    assert tokenizer_type_for(str(tmp_path)) == "huggingface"
    assert tokenizer_type_for("sp.model") == "sentencepiece"
    assert tokenizer_type_for("cl100k_base.tiktoken") == "tiktoken"


@pytest.mark.parametrize("args, message", [
    (["--input", "{d}/none*.jsonl", "--output", "{d}/o"], r"--input='.*none\*.jsonl' matches no file"),
    (["--input", "{d}/c.jsonl", "--output", "{d}/o", "--column", "body"], r"c.jsonl line 1 has no column 'body'"),
    (["--input", "{d}/bad.jsonl", "--output", "{d}/o"], r"bad.jsonl line 2 is not JSON"),
    (["--input", "{d}/c.jsonl", "--output", "{d}/o", "--tokenizer-type", "gpt2"], r"invalid choice: 'gpt2'"),
    (["--input", "{d}/c.jsonl", "--output", "{d}/o", "--tokenizer", "{d}/tok.bin"], r"cannot tell its type"),
    (["--input", "{d}/c.jsonl", "--output", "{d}/o", "--tokenizer", "{d}/no.model"], r"no.model' does not exist"),
    (["--input", "{d}/c.csv", "--output", "{d}/o"], r"cannot read .csv"),
    (["--input", "{d}/c.jsonl"], r"required: --output"),
    (["--input", "{d}/c.jsonl", "--output", "{d}/done"], r"documents.array_record already exists; pass --overwrite"),
])
def test_prepare_user_errors_are_one_line_exit_2(tmp_path, capsys, args, message):
    corpora.write_jsonl(tmp_path / "c.jsonl", ["text one", "text two"])
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"text": \n')
    (tmp_path / "c.csv").write_text("text\nx\n")
    (tmp_path / "tok.bin").write_bytes(b"x")
    (tmp_path / "done").mkdir()
    (tmp_path / "done" / "documents.array_record").write_bytes(b"")
    assert main(["prepare", *[a.format(d=tmp_path) for a in args]]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and re.search(message, err[0]), err
    assert not (tmp_path / "o").exists() or not os.listdir(tmp_path / "o")
