"""The JAX versions this package is tested on, and a check that refuses the others.

Two legs, one codebase (pyproject.toml pins each by Python version; CI runs both):
- Python 3.10-3.11: JAX 0.10.2.
- Python 3.12+: JAX 0.11.x and 0.12.x (0.12.0.1 pinned and tested; NVIDIA's JAX container and
  MaxText run this leg).

`python -m nvfp4_jax.jax_window` prints the installed JAX and exits 0 inside the window, or
prints one `error:` line and exits 2 outside it (the container's build runs it: docker/). It
imports no JAX module beyond reading the installed version, so it is cheap.
"""

from __future__ import annotations

import importlib.metadata
import re
import sys

# (lowest, highest) release series per leg: inclusive bounds on (major, minor, patch).
WINDOW = (
    ((0, 10, 2), (0, 10, 2), "Python 3.10-3.11"),
    ((0, 11, 0), (0, 12, 99), "Python 3.12+"),
)
DESCRIPTION = "JAX 0.10.2 (Python 3.10-3.11) or JAX 0.11.x-0.12.x (Python 3.12+)"


def parse(version: str) -> tuple[int, int, int]:
    """(major, minor, patch) of a JAX version string such as '0.12.0.1' or '0.11.2.dev20261101'."""
    m = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
    if not m:
        raise ValueError(f"not a JAX version: {version!r}")
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def problem(version: str) -> str | None:
    """None if `version` is inside the supported window, else why not (one line)."""
    try:
        v = parse(version)
    except ValueError as e:
        return str(e)
    if any(lo <= v <= hi for lo, hi, _ in WINDOW):
        return None
    return f"jax {version} is outside the supported window: {DESCRIPTION}"


def installed_jax() -> str:
    return importlib.metadata.version("jax")


def main(argv=None) -> int:
    try:
        version = installed_jax()
    except importlib.metadata.PackageNotFoundError:
        print(f"error: jax is not installed; nvfp4_jax needs {DESCRIPTION}", file=sys.stderr)
        return 2
    why = problem(version)
    if why:
        print(f"error: {why} (install one of those, e.g. pip install -e . on a matching Python)",
              file=sys.stderr)
        return 2
    print(f"jax {version}: inside the supported window ({DESCRIPTION})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
