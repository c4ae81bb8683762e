"""Parameters checkpoints carry per-array checksums: a changed, reshaped or unwritable array is
one `error:` line naming it, exit 2, and nothing partial is left behind."""

import json
import os

import numpy as np
import pytest

from nvfp4_jax.convert import checkpoints as convert_lib
from nvfp4_jax.convert.__main__ import main
from nvfp4_jax.train import params_checkpoint as params_lib

LEAF = ("layers", "mlp", "up", "kernel")


@pytest.fixture
def ours(tmp_path, hf_dir):
    out = str(tmp_path / "ours")
    convert_lib.from_hf(hf_dir[0], out, {"scan_layers": "true"})
    return out


def _one_error(capsys):
    err = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("WARNING:absl")]
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def test_host_checksum_is_the_device_checksum():
    import jax.numpy as jnp
    import ml_dtypes

    from nvfp4_jax.train import integrity

    rng = np.random.default_rng(0)
    for dtype in (np.float32, ml_dtypes.bfloat16, np.int32):
        for shape in ((), (7,), (3, 1234), (0, 3)):
            x = (100 * rng.standard_normal(shape)).astype(dtype)
            assert integrity.host_leaf_checksum(x) == tuple(int(v) for v in np.asarray(integrity.leaf_checksum(jnp.asarray(x))))


def test_a_changed_array_is_named_by_to_hf(tmp_path, ours, capsys):
    array = params_lib.restore_numpy(ours)["layers"]["mlp"]["up"]["kernel"].copy()
    array.view(np.uint32)[1, 2, 3] ^= 1 << 30  # one flipped bit
    import shutil

    shutil.rmtree(os.path.join(ours, "params", ".".join(LEAF)))
    params_lib.write_leaf(ours, LEAF, array)
    assert main(["to-hf", ours, str(tmp_path / "back")]) == 2
    assert "checksum mismatch in array layers.mlp.up.kernel" in _one_error(capsys)
    assert not os.path.exists(tmp_path / "back")


def test_a_wrong_shape_array_is_one_line_and_leaves_nothing(tmp_path, ours, capsys):
    import shutil

    shutil.rmtree(os.path.join(ours, "params", ".".join(LEAF)))
    params_lib.write_leaf(ours, LEAF, np.zeros((3, 32, 40), np.float32))
    assert main(["to-hf", ours, str(tmp_path / "back")]) == 2
    assert "array layers.mlp.up.kernel of" in _one_error(capsys)
    assert not os.path.exists(tmp_path / "back")


def test_a_checkpoint_without_checksums_converts_with_one_warning(tmp_path, ours, capsys):
    meta_path = os.path.join(ours, params_lib.META_FILE)
    with open(meta_path) as f:
        meta = json.load(f)
    del meta["checksums"]
    with open(meta_path, "w") as f:
        json.dump(meta, f)
    assert main(["to-hf", ours, str(tmp_path / "back")]) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "records no checksums" in warnings[0]


def test_to_hf_on_a_full_disk_removes_its_partial_file(tmp_path, ours, capsys, monkeypatch):
    import errno

    def full(array):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    real = convert_lib._hf_array
    monkeypatch.setattr(convert_lib, "_hf_array", lambda *a: full(real(*a)))
    assert main(["to-hf", ours, str(tmp_path / "back")]) == 2
    assert "No space left on device" in _one_error(capsys)
    assert os.listdir(tmp_path / "back") == []


def test_load_parameters_path_refuses_a_changed_array_in_one_line(tmp_path, ours):
    import shutil

    from nvfp4_jax.config import ConfigError, load_config
    from nvfp4_jax.train import assembly

    from test_load_parameters import _run_args

    array = params_lib.restore_numpy(ours)["layers"]["mlp"]["up"]["kernel"].copy()
    array[0, 0, 0] += 1.0
    shutil.rmtree(os.path.join(ours, "params", ".".join(LEAF)))
    params_lib.write_leaf(ours, LEAF, array)
    cfg = load_config(_run_args(tmp_path, ours))
    parts = assembly.assemble(cfg)
    state, state_sh = parts.init_state(seed=0), parts.state_shardings
    with pytest.raises(ConfigError, match="checksum mismatch in array layers.mlp.up.kernel") as err:
        params_lib.load_into(ours, state, state_sh)
    assert "\n" not in str(err.value)


def test_from_hf_on_a_full_disk_is_one_line_and_removes_what_it_wrote(tmp_path, hf_dir, capsys, monkeypatch):
    def full(*args, **kwargs):
        raise ValueError("RESOURCE_EXHAUSTED: Failed to write: No space left on device [os_error_code='28']")

    monkeypatch.setattr(params_lib, "write_leaf", full)
    out = str(tmp_path / "ours")
    assert main(["from-hf", hf_dir[0], out]) == 2
    assert "(OSError: No space left on device); removed what was written" in _one_error(capsys)
    assert os.listdir(out) == []
