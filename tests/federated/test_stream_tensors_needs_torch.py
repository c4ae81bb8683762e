"""`--stream-tensors` without torch (the `federated` extra does not install it): one error line
naming what to install, exit 2, before any job is built."""

import sys

import pytest

from nvfp4_jax.federated.__main__ import main


def test_stream_tensors_without_torch_is_one_error_line(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "torch", None)  # as if torch were not installed
    assert main(["--sites", "1", "--stream-tensors", f"base_output_directory={tmp_path}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --stream-tensors needs torch")
    assert "pip install torch" in err[0]
    assert not (tmp_path / "federated").exists()  # refused before the corpus split or the job


def test_the_help_says_stream_tensors_needs_torch(capsys):
    assert main(["--help"]) == 0
    assert "torch, which the federated extra does not install" in capsys.readouterr().out
