"""`prepare` on a full disk: one error line, and its `.partial` file removed."""

import errno
import os

from nvfp4_jax.data import __main__ as prepare_cli


class _FullDiskWriter:
    def __init__(self, path, options):
        self._file = open(path, "wb")

    def write(self, data):
        self._file.write(data)

    def close(self):  # the last flush finds the disk full
        self._file.close()
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


class _Module:
    ArrayRecordWriter = _FullDiskWriter


def test_prepare_on_a_full_disk_is_one_line_and_removes_its_partial_file(tmp_path, capsys, monkeypatch):
    (tmp_path / "a.txt").write_text("a whole file\nis one document\n")
    monkeypatch.setattr(prepare_cli, "require", lambda *a: _Module)
    out = tmp_path / "out"
    assert prepare_cli.main(["prepare", "--tokenizer-type", "bytes", "--input", str(tmp_path / "a.txt"),
                             "--output", str(out)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("error: writing ") and "No space left on device" in err[0], err
    assert os.listdir(out) == []
