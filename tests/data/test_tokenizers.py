import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
import corpora  # noqa: E402

from nvfp4_jax.data import DataError, check_vocab, load_tokenizer  # noqa: E402

SAMPLE = "To be, or not to be — ça va, 東京? the sea of troubles"


def test_bytes_tokenizer_is_utf8_with_bos_and_eos_past_the_bytes():
    tok = load_tokenizer("bytes")
    ids = tok.encode(SAMPLE, add_bos=True, add_eos=True)
    assert ids.dtype == np.int32
    assert ids[0] == 256 and ids[-1] == 257 and tok.vocab_size == 258
    np.testing.assert_array_equal(ids[1:-1], list(SAMPLE.encode("utf-8")))
    assert tok.decode(ids) == SAMPLE  # specials are left out
    np.testing.assert_array_equal(tok.encode("ab"), [97, 98])


def test_huggingface_matches_the_library(tmp_path):
    from tokenizers import Tokenizer

    path = corpora.huggingface_tokenizer(tmp_path)
    tok = load_tokenizer("huggingface", path)
    lib = Tokenizer.from_file(path)
    expected = lib.encode(SAMPLE, add_special_tokens=False).ids
    assert len(expected) < len(SAMPLE.encode())  # merges were learned
    bos, eos = lib.token_to_id("<s>"), lib.token_to_id("</s>")
    assert (tok.bos_id, tok.eos_id) == (bos, eos)
    np.testing.assert_array_equal(tok.encode(SAMPLE, add_bos=True, add_eos=True), [bos, *expected, eos])
    np.testing.assert_array_equal(tok.encode(SAMPLE), expected)
    assert tok.vocab_size == lib.get_vocab_size(with_added_tokens=True)
    assert tok.decode(tok.encode(SAMPLE, add_bos=True, add_eos=True)) == SAMPLE
    # A folder holding tokenizer.json works too.
    np.testing.assert_array_equal(load_tokenizer("huggingface", str(tmp_path)).encode(SAMPLE), expected)


def test_huggingface_bos_eos_from_tokenizer_config(tmp_path):
    path = corpora.huggingface_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text('{"bos_token": "</s>", "eos_token": {"content": "<unk>"}}')
    tok = load_tokenizer("huggingface", path)
    from tokenizers import Tokenizer

    lib = Tokenizer.from_file(path)
    assert (tok.bos_id, tok.eos_id) == (lib.token_to_id("</s>"), lib.token_to_id("<unk>"))


def test_sentencepiece_matches_the_library(tmp_path):
    import sentencepiece as spm

    path = corpora.sentencepiece_model(tmp_path)
    tok = load_tokenizer("sentencepiece", path)
    lib = spm.SentencePieceProcessor(model_file=path)
    expected = lib.encode(SAMPLE)
    assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (1, 2, 400)
    np.testing.assert_array_equal(tok.encode(SAMPLE, add_bos=True, add_eos=True), [1, *expected, 2])
    np.testing.assert_array_equal(lib.encode(SAMPLE, add_bos=True, add_eos=True), [1, *expected, 2])
    assert tok.decode(tok.encode(SAMPLE, add_eos=True)) == lib.decode(expected)


def test_tiktoken_matches_the_librarys_own_file_reader(tmp_path):
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe

    from nvfp4_jax.data.tokenizer import LLAMA3_PATTERN

    path = corpora.tiktoken_file(tmp_path)
    tok = load_tokenizer("tiktoken", path)
    lib = tiktoken.Encoding("ref", pat_str=LLAMA3_PATTERN, mergeable_ranks=load_tiktoken_bpe(path),
                            special_tokens={})
    expected = lib.encode_ordinary(SAMPLE)
    assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (263, 264, 265)
    np.testing.assert_array_equal(tok.encode(SAMPLE, add_bos=True, add_eos=True), [263, *expected, 264])
    # By hand: " the" is rank 260 (merge " t" then "the" pieces), "to" rank 258, " be" rank 262.
    np.testing.assert_array_equal(tok.encode("to be the"), [258, 262, 260])
    assert tok.decode(tok.encode(SAMPLE, add_bos=True)) == SAMPLE


@pytest.mark.parametrize("kind, content, message", [
    ("huggingface", b"{not json", "is not a tokenizers JSON file"),
    ("sentencepiece", b"\x00garbage", "is not a SentencePiece model"),
    ("tiktoken", b"not-base64!! x\n", "line 1 is not 'base64-token rank'"),
])
def test_corrupt_tokenizer_files_are_data_errors(tmp_path, kind, content, message):
    path = tmp_path / "tok"
    path.write_bytes(content)
    with pytest.raises(DataError, match=message):
        load_tokenizer(kind, str(path))


def test_bad_tokenizer_arguments(tmp_path):
    with pytest.raises(DataError, match="tokenizer_type='gpt2' is not one of bytes, huggingface"):
        load_tokenizer("gpt2", "x")
    with pytest.raises(DataError, match=r"tokenizer_path='.*nope.json' does not exist"):
        load_tokenizer("huggingface", str(tmp_path / "nope.json"))
    with pytest.raises(DataError, match="needs tokenizer_path"):
        load_tokenizer("sentencepiece", "")
    with pytest.raises(DataError, match="is not a file"):
        load_tokenizer("tiktoken", str(tmp_path))
    with pytest.raises(DataError, match=r"vocab_size=256 is smaller than the tokenizer bytes \(258 ids.*"
                                        r"vocab_size=258 or more"):
        check_vocab(load_tokenizer("bytes"), 256)
    check_vocab(load_tokenizer("bytes"), 258)


def test_tokenizer_without_eos_refuses_add_eos(tmp_path):
    import sentencepiece as spm

    prefix = str(tmp_path / "noeos")
    spm.SentencePieceTrainer.train(sentence_iterator=iter(corpora.TEXTS), model_prefix=prefix, vocab_size=60,
                                   bos_id=-1, eos_id=-1, unk_id=0, minloglevel=2)
    tok = load_tokenizer("sentencepiece", prefix + ".model")
    assert tok.bos_id is None and tok.eos_id is None
    with pytest.raises(DataError, match="has no EOS token; set add_eos=false"):
        tok.encode("x", add_eos=True)


def test_a_missing_library_names_the_extra(monkeypatch, tmp_path):
    path = corpora.tiktoken_file(tmp_path)
    monkeypatch.setitem(sys.modules, "tiktoken", None)  # what an uninstalled package looks like to import
    with pytest.raises(DataError, match=r"tokenizer_type='tiktoken' needs the Python package 'tiktoken'.*"
                                        r"pip install 'nvfp4_jax\[data\]'"):
        load_tokenizer("tiktoken", path)
