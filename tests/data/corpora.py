"""Small tokenizers and corpora built locally for the data tests (nothing is downloaded)."""

import base64
import json
import os

import numpy as np

TEXTS = [
    "To be, or not to be: that is the question.",
    "Whether 'tis nobler in the mind to suffer",
    "The slings and arrows of outrageous fortune,",
    "Or to take arms against a sea of troubles — ça va, 東京?",
    "And by opposing end them. To die: to sleep;",
    "No more; and by a sleep to say we end",
] * 4


def huggingface_tokenizer(directory) -> str:
    """A BPE tokenizer.json trained on TEXTS, with <s> and </s>; returns its path."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(TEXTS, trainer)
    path = os.path.join(str(directory), "tokenizer.json")
    tok.save(path)
    return path


def sentencepiece_model(directory) -> str:
    import sentencepiece as spm

    prefix = os.path.join(str(directory), "sp")
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(TEXTS), model_prefix=prefix, vocab_size=400, model_type="bpe",
        character_coverage=1.0, byte_fallback=True, bos_id=1, eos_id=2, unk_id=0, pad_id=-1,
        minloglevel=2)
    return prefix + ".model"


def tiktoken_file(directory) -> str:
    """Byte ranks 0-255 plus a few merges, in tiktoken's `base64 rank` format."""
    merges = [b"th", b"the", b"to", b" t", b" the", b"be", b" be"]
    ranks = [bytes([i]) for i in range(256)] + merges
    path = os.path.join(str(directory), "tiny.tiktoken")
    with open(path, "wb") as f:
        for rank, token in enumerate(ranks):
            f.write(base64.b64encode(token) + b" " + str(rank).encode() + b"\n")
    return path


def write_jsonl(path, texts, column="text") -> str:
    with open(path, "w") as f:
        for t in texts:
            f.write(json.dumps({column: t, "id": 0}) + "\n")
    return str(path)


def write_parquet(path, texts, column="text") -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({column: texts, "n": np.arange(len(texts))}), str(path))
    return str(path)
