"""The container cannot be built here (no Docker engine); check what can be checked."""

import os
import re

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCKERFILE = os.path.join(REPO, "docker", "Dockerfile")


def _instructions():
    text = open(DOCKERFILE).read().replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            out.append((keyword.upper(), rest.strip()))
    return out


def test_dockerfile_parses_and_uses_nvidias_maxtext_image():
    instructions = _instructions()
    known = {"FROM", "WORKDIR", "COPY", "RUN", "ENV", "ENTRYPOINT", "CMD", "ARG", "LABEL"}
    assert {k for k, _ in instructions} <= known
    assert instructions[0] == ("FROM", "ghcr.io/nvidia/jax:maxtext")


def test_every_copied_path_exists():
    copies = [rest.split() for k, rest in _instructions() if k == "COPY"]
    assert copies
    for parts in copies:
        for source in parts[:-1]:
            assert os.path.exists(os.path.join(REPO, source)), source


def test_entrypoint_is_the_example_script():
    entry = [rest for k, rest in _instructions() if k == "ENTRYPOINT"]
    script = re.findall(r'"([^"]+)"', entry[0])[0]
    path = os.path.join(REPO, script)
    assert os.path.exists(path) and os.access(path, os.X_OK)


def test_build_checks_the_images_jax_against_the_supported_window():
    runs = " ".join(rest for k, rest in _instructions() if k == "RUN")
    install = runs.index("--no-deps -e .")
    assert runs.index("python -m nvfp4_jax.jax_window") > install  # after the package is there


@pytest.mark.parametrize("version,inside", [
    ("0.10.2", True), ("0.11.0", True), ("0.11.2", True), ("0.12.0.1", True),
    ("0.12.1.dev20261201", True), ("0.10.1", False), ("0.9.2", False), ("0.13.0", False),
    ("1.0.0", False), ("not-a-version", False),
])
def test_jax_window(version, inside):
    from nvfp4_jax import jax_window

    why = jax_window.problem(version)
    assert (why is None) == inside, why
    if not inside:
        assert "\n" not in why and version in why


def test_jax_window_cli_exits_2_outside(monkeypatch, capsys):
    from nvfp4_jax import jax_window

    monkeypatch.setattr(jax_window, "installed_jax", lambda: "0.9.0")
    assert jax_window.main() == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: jax 0.9.0 is outside")
    monkeypatch.setattr(jax_window, "installed_jax", lambda: "0.12.0.1")
    assert jax_window.main() == 0
