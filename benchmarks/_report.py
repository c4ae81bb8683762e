"""What every benchmark records about where it ran, and how it writes its JSON."""

from __future__ import annotations

import json
import os
import platform
import subprocess
from pathlib import Path

import jax


def package_revision() -> str:
    """The git commit the package was measured at, `+dirty` when nvfp4_jax/ has local changes."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def git(*args):
        return subprocess.run(["git", "-C", root, *args], capture_output=True, text=True).stdout.strip()

    try:
        rev = git("rev-parse", "--short", "HEAD")
        return (rev + "+dirty" if git("status", "--porcelain", "--", "nvfp4_jax") else rev) or "unknown"
    except OSError:
        return "unknown"


def environment() -> dict:
    return dict(
        package_revision=package_revision(),
        jax=jax.__version__,
        device=str(jax.devices()[0]),
        cpu_count=os.cpu_count(),
        machine=platform.machine(),
    )


def write_json(path: Path, result: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")


def write_result(path: Path, leading: dict, *, note: str, rows: list, **fields) -> dict:
    """Writes and returns a results file: `leading` (what was run), the environment, `fields`,
    the note that says what the numbers mean, then the rows."""
    result = dict(**leading, **environment(), **fields, note=note, rows=rows)
    write_json(path, result)
    return result


def save_plot(path: Path, draw, *, figsize=(6, 4)) -> None:
    """`draw(ax)` on one axes, with a legend, saved beside the results as `path` with `.png`;
    nothing without matplotlib (the `plot` extra)."""
    try:
        import matplotlib
    except ImportError:
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=figsize)
    draw(ax)
    ax.legend()
    fig.tight_layout()
    fig.savefig(Path(path).with_suffix(".png"), dpi=120)
