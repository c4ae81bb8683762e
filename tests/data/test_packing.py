import numpy as np
import pytest

from nvfp4_jax.data import packing


def _rows(docs, seq_len, packed):
    lengths = np.array([len(d) for d in docs])
    chunks = packing.chunk(np.arange(len(docs)), lengths, seq_len)
    bounds = packing.row_bounds(chunks.pairs, seq_len, packed)
    rows = []
    for r in range(len(bounds) - 1):
        span = range(bounds[r], bounds[r + 1])
        rows.append(packing.assemble_row(
            [docs[chunks.doc[i]][chunks.start[i]:chunks.start[i] + chunks.pairs[i] + 1] for i in span], seq_len))
    return rows


def test_packed_rows_against_a_hand_packing():
    # Documents (BOS=1 ... EOS=2) of 4, 3, 5 and 2 tokens: 3, 2, 4 and 1 pairs; rows of 6.
    docs = [np.array([1, 10, 11, 2]), np.array([1, 20, 2]), np.array([1, 30, 31, 32, 2]), np.array([1, 2])]
    rows = _rows(docs, 6, packed=True)
    assert len(rows) == 2
    first, second = rows
    np.testing.assert_array_equal(first["inputs"], [1, 10, 11, 1, 20, 0])
    np.testing.assert_array_equal(first["targets"], [10, 11, 2, 20, 2, 0])
    np.testing.assert_array_equal(first["inputs_segmentation"], [1, 1, 1, 2, 2, 0])
    np.testing.assert_array_equal(first["inputs_position"], [0, 1, 2, 0, 1, 0])
    np.testing.assert_array_equal(first["targets_segmentation"], [1, 1, 1, 2, 2, 0])
    # The 4-pair document does not fit in the one slot left: it opens row 2, the 1-pair one follows.
    np.testing.assert_array_equal(second["inputs"], [1, 30, 31, 32, 1, 0])
    np.testing.assert_array_equal(second["targets"], [30, 31, 32, 2, 2, 0])
    np.testing.assert_array_equal(second["inputs_segmentation"], [1, 1, 1, 1, 2, 0])
    np.testing.assert_array_equal(second["inputs_position"], [0, 1, 2, 3, 0, 0])
    for row in rows:
        assert all(row[k].dtype == np.int32 for k in packing.BATCH_KEYS)


def test_padded_rows_hold_one_chunk_each():
    docs = [np.array([1, 10, 11, 2]), np.array([1, 20, 2])]
    rows = _rows(docs, 5, packed=False)
    assert len(rows) == 2
    np.testing.assert_array_equal(rows[1]["inputs"], [1, 20, 0, 0, 0])
    np.testing.assert_array_equal(rows[1]["targets"], [20, 2, 0, 0, 0])
    np.testing.assert_array_equal(rows[1]["targets_segmentation"], [1, 1, 0, 0, 0])
    np.testing.assert_array_equal(rows[1]["inputs_position"], [0, 1, 0, 0, 0])


def test_long_documents_are_cut_into_segments_whose_positions_restart():
    doc = np.arange(100, 111)  # 11 tokens, 10 pairs; rows of 4 -> chunks of 4, 4, 2 pairs
    chunks = packing.chunk(np.array([0]), np.array([11]), 4)
    np.testing.assert_array_equal(chunks.start, [0, 4, 8])
    np.testing.assert_array_equal(chunks.pairs, [4, 4, 2])
    rows = _rows([doc], 4, packed=True)
    np.testing.assert_array_equal(rows[0]["inputs"], [100, 101, 102, 103])
    np.testing.assert_array_equal(rows[1]["inputs"], [104, 105, 106, 107])
    np.testing.assert_array_equal(rows[1]["targets"], [105, 106, 107, 108])  # no pair is lost at the cut
    np.testing.assert_array_equal(rows[2]["targets"], [109, 110, 0, 0])
    np.testing.assert_array_equal(rows[2]["inputs_position"], [0, 1, 0, 0])
    # Every (input, target) pair of the document appears exactly once.
    pairs = {(int(a), int(b)) for r in rows for a, b, s in zip(r["inputs"], r["targets"], r["targets_segmentation"]) if s}
    assert pairs == {(100 + i, 101 + i) for i in range(10)}


def test_chunks_of_a_random_corpus_cover_every_pair_once():
    rng = np.random.default_rng(0)
    lengths = rng.integers(0, 40, size=200)
    order = rng.permutation(200)
    chunks = packing.chunk(order, lengths, 16)
    assert chunks.pairs.sum() == np.maximum(lengths - 1, 0).sum()
    assert chunks.pairs.min() >= 1 and chunks.pairs.max() <= 16
    # Documents appear in `order`, and each one's chunks are consecutive and tile it.
    seen = list(dict.fromkeys(chunks.doc.tolist()))
    assert seen == [d for d in order.tolist() if lengths[d] > 1]
    for d in seen[:20]:
        mine = chunks.doc == d
        np.testing.assert_array_equal(chunks.start[mine], np.arange(mine.sum()) * 16)
    bounds = packing.row_bounds(chunks.pairs, 16, True)
    used = np.add.reduceat(chunks.pairs, bounds[:-1])
    assert used.max() <= 16
    # Next fit: each row's successor's first chunk would not have fitted.
    assert all(used[r] + chunks.pairs[bounds[r + 1]] > 16 for r in range(len(used) - 1))


def test_a_chunk_that_does_not_fit_is_an_error():
    with pytest.raises(ValueError, match="does not fit"):
        packing.assemble_row([np.arange(4), np.arange(4)], 5)
