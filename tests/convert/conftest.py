"""The `hf_dir` fixture: a small HF Llama folder (see _hf_files.py)."""

import pytest

from _hf_files import write_hf_dir


@pytest.fixture
def hf_dir(tmp_path):
    path = str(tmp_path / "hf")
    return path, write_hf_dir(path)
