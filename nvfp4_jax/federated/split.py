"""Site data for experiments: the bundled corpus split by play, non-IID under a Dirichlet prior.

The corpus holds 38 plays in six groups (comedies, histories, problem plays, romances, Roman
and other tragedies: the folders the bundled
`SHAKESPEARE.md` lists them). `dirichlet_split` gives each genre's plays to the sites in
proportions drawn from `Dirichlet(alpha)`: a large alpha spreads every genre evenly (close to
IID), a small one gives each genre to one or two sites (strongly non-IID). Every play goes to
exactly one site, and every site gets at least one play.

The server evaluates the global model on the corpus's eval split (its last `eval_fraction` of
bytes, `data.eval_boundary`), so the sites' files hold only the text before it
(`training_plays`): the plays after the boundary stay with the server, and the play it cuts
keeps only its first part. No site trains on a byte the server evaluates on.
"""

from __future__ import annotations

import dataclasses
import os
import re
from importlib import resources

import numpy as np

from nvfp4_jax import data as data_lib


@dataclasses.dataclass(frozen=True)
class Play:
    title: str
    genre: str
    text: str


def _genres() -> list[str]:
    listing = resources.files("nvfp4_jax").joinpath("assets/SHAKESPEARE.md").read_text()
    return re.findall(r"^- `(\w+)/[^`]+\.md`$", listing, flags=re.M)


def bundled_plays() -> list[Play]:
    """The bundled corpus as its plays, in corpus order."""
    text = data_lib.shakespeare_bytes().decode("utf-8")
    lines = text.split("\n")
    starts = [i - 2 for i, line in enumerate(lines) if line == "ACT I"]
    genres = _genres()
    if len(starts) != len(genres):
        raise RuntimeError(f"the bundled corpus has {len(starts)} plays but its listing names {len(genres)}")
    ends = starts[1:] + [len(lines)]
    return [Play(title=lines[s], genre=g, text="\n".join(lines[s:e]))
            for s, e, g in zip(starts, ends, genres)]


def training_plays(eval_fraction: float) -> list[Play]:
    """The plays as the sites may hold them: each cut at the corpus's eval boundary (a play that
    starts after it is left out, the one it falls in keeps its part before it)."""
    corpus = data_lib.shakespeare_bytes()
    boundary = data_lib.eval_boundary(len(corpus), eval_fraction)
    out, offset = [], 0
    for play in bundled_plays():
        raw = play.text.encode("utf-8")
        if offset >= boundary:
            break
        if offset + len(raw) > boundary:  # the play holding the boundary: its train part only
            play = dataclasses.replace(play, text=raw[: boundary - offset].decode("utf-8", errors="ignore"))
        out.append(play)
        offset += len(raw) + 1  # the plays are joined by one newline
    return out


def dirichlet_split(genres: list, num_sites: int, alpha: float, seed: int, unit: str = "plays") -> list[list[int]]:
    """Item indices per site (plays; or images, whose `genres` are their classes): for each
    genre, proportions ~ Dirichlet(alpha, ..., alpha) over the sites, and that genre's items
    dealt out in those proportions. `unit` names the items in errors."""
    if num_sites < 1:
        raise ValueError(f"sites={num_sites} must be at least 1")
    if num_sites > len(genres):
        raise ValueError(f"sites={num_sites}: there are only {len(genres)} {unit} to split")
    if not (alpha > 0 and np.isfinite(alpha)):
        raise ValueError(f"dirichlet_alpha={alpha} must be a positive finite number")
    rng = np.random.default_rng(seed)
    sites: list[list[int]] = [[] for _ in range(num_sites)]
    for genre in sorted(set(genres)):
        members = [i for i, g in enumerate(genres) if g == genre]
        members = [members[j] for j in rng.permutation(len(members))]
        share = rng.dirichlet([alpha] * num_sites)
        cuts = np.round(np.cumsum(share) * len(members)).astype(int)
        start = 0
        for site, stop in enumerate(cuts):
            sites[site].extend(members[start:stop])
            start = stop
    # No site left empty: an empty site takes one play from the site holding the most.
    for site in range(num_sites):
        if not sites[site]:
            donor = max(range(num_sites), key=lambda s: len(sites[s]))
            sites[site].append(sites[donor].pop())
    return [sorted(s) for s in sites]


def write_site_corpora(directory: str, num_sites: int, alpha: float, seed: int,
                       eval_fraction: float) -> list[dict]:
    """Writes `site-<i>.txt` for each site into `directory`, from the corpus before the server's
    eval split (`training_plays(eval_fraction)`); returns what each holds."""
    plays = training_plays(eval_fraction)
    assignment = dirichlet_split([p.genre for p in plays], num_sites, alpha, seed)
    os.makedirs(directory, exist_ok=True)
    out = []
    for i, members in enumerate(assignment, start=1):
        path = os.path.join(directory, f"site-{i}.txt")
        text = "\n".join(plays[j].text for j in members) + "\n"
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        genres = {}
        for j in members:
            genres[plays[j].genre] = genres.get(plays[j].genre, 0) + 1
        out.append({"site": f"site-{i}", "path": path, "plays": len(members), "bytes": len(text.encode()),
                    "genres": genres})
    return out
