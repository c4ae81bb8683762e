"""The Dirichlet split of the bundled corpus by play."""

import numpy as np
import pytest

from nvfp4_jax import data as data_lib
from nvfp4_jax.federated.split import bundled_plays, dirichlet_split, training_plays, write_site_corpora


def test_the_corpus_is_its_38_plays_in_order():
    plays = bundled_plays()
    assert len(plays) == 38
    assert plays[0].title == "A Midsummer Night's Dream" and plays[0].genre == "comedies"
    # The plays put back together are the corpus (nothing lost or duplicated at the seams).
    assert "\n".join(p.text for p in plays) == data_lib.shakespeare_bytes().decode("utf-8")


def _genre_spread(genres, sites):
    """Per genre, the largest fraction of its plays any one site holds."""
    out = []
    for g in set(genres):
        members = [i for i, x in enumerate(genres) if x == g]
        out.append(max(sum(1 for i in members if i in set(s)) for s in sites) / len(members))
    return float(np.mean(out))


@pytest.mark.parametrize("num_sites", [1, 2, 5])
def test_every_play_goes_to_exactly_one_site_and_no_site_is_empty(num_sites):
    genres = [p.genre for p in bundled_plays()]
    sites = dirichlet_split(genres, num_sites, alpha=0.1, seed=3)
    assert sorted(i for s in sites for i in s) == list(range(38))
    assert all(sites)
    assert dirichlet_split(genres, num_sites, alpha=0.1, seed=3) == sites  # seeded


def test_alpha_controls_how_non_iid_the_sites_are():
    genres = [p.genre for p in bundled_plays()]
    # Averaged over seeds: a small alpha puts most of each genre on one site; a large one spreads
    # it close to evenly (the IID limit is 1/3 of each genre per site, rounded to whole plays).
    small = np.mean([_genre_spread(genres, dirichlet_split(genres, 3, 0.05, s)) for s in range(20)])
    large = np.mean([_genre_spread(genres, dirichlet_split(genres, 3, 1000.0, s)) for s in range(20)])
    assert small > 0.85
    assert large < 0.55


def test_site_files_hold_their_plays(tmp_path):
    holdings = write_site_corpora(str(tmp_path), 3, alpha=1.0, seed=0, eval_fraction=0.05)
    assert [h["site"] for h in holdings] == ["site-1", "site-2", "site-3"]
    assert sum(h["plays"] for h in holdings) == len(training_plays(0.05))
    for h in holdings:
        assert (tmp_path / f"{h['site']}.txt").stat().st_size == h["bytes"]


def test_bad_splits():
    genres = [p.genre for p in bundled_plays()]
    with pytest.raises(ValueError, match="only 38 plays"):
        dirichlet_split(genres, 39, 1.0, 0)
    with pytest.raises(ValueError, match="dirichlet_alpha=0"):
        dirichlet_split(genres, 2, 0.0, 0)


def test_the_training_plays_are_the_corpus_before_its_eval_split():
    corpus = data_lib.shakespeare_bytes()
    boundary = data_lib.eval_boundary(len(corpus), 0.05)
    plays = training_plays(0.05)
    assert 30 < len(plays) < 38  # the last plays are held out whole, one is cut
    assert "\n".join(p.text for p in plays).encode("utf-8") == corpus[:boundary]


@pytest.mark.parametrize("num_sites, seed", [(1, 0), (3, 0), (3, 2), (5, 7)])
def test_no_site_file_shares_text_with_the_servers_eval_split(tmp_path, num_sites, seed):
    """Every 200-byte window of the server's eval text (stride 100) is absent from every site's
    file. With whole plays dealt out (the old split) the sites held 2,490 of the 2,492 windows
    (3 sites, seed 0): the eval text was training text."""
    corpus = data_lib.shakespeare_bytes()
    held_out = corpus[data_lib.eval_boundary(len(corpus), 0.05):]
    write_site_corpora(str(tmp_path), num_sites, alpha=0.5, seed=seed, eval_fraction=0.05)
    windows = [held_out[i:i + 200] for i in range(0, len(held_out) - 200, 100)]
    for site in range(1, num_sites + 1):
        text = (tmp_path / f"site-{site}.txt").read_bytes()
        shared = [w for w in windows if w in text]
        assert not shared, f"site-{site} holds {len(shared)} of {len(windows)} eval windows"
