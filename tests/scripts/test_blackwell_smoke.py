"""scripts/blackwell_smoke.sh cannot run here (no Blackwell, no TE): it must parse, and its
Python half must do the right thing on CPU (xla through the jnp stand-in of scaled_matmul)."""

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "scripts"))

import blackwell_smoke as smoke  # noqa: E402

from nvfp4_jax.quant import make_backend, scaled_matmul_reference  # noqa: E402


def test_shell_script_parses():
    subprocess.run(["bash", "-n", os.path.join(REPO, "scripts", "blackwell_smoke.sh")], check=True)


def test_kernel_proof_reads_compiled_hlo():
    te = '%c = (bf16[256,768]) custom-call(...), custom_call_target="te_gemm_v2_ffi"'
    cudnn = 'kind=kCustom, backend_config={"fusion_backend_config":{"kind":"__cudnn$fusion"}}, composite.name="block_scaled_dot"'
    plain = "%d = f32[1,256,768] dot(f32[1,256,512] %a, f32[1,768,512] %b)"
    assert smoke.kernel_ran(te, "te") and not smoke.kernel_ran(plain, "te") and not smoke.kernel_ran(cudnn, "te")
    assert smoke.kernel_ran(cudnn, "xla") and not smoke.kernel_ran(plain, "xla") and not smoke.kernel_ran(te, "xla")


def test_relative_error():
    assert smoke.relative_error([3.0, 4.0], [3.0, 4.0]) == 0
    assert smoke.relative_error([3.0, 4.0], [0.0, 5.0]) == pytest.approx(((9 + 1) ** 0.5) / 5)


@pytest.mark.slow
def test_projection_comparison_on_cpu_with_the_stand_in():
    rows = smoke.compare_backends(
        "te_nvfp4", {"xla": make_backend("xla", scaled_matmul=scaled_matmul_reference)}, shape=(2, 32, 64, 48)
    )
    (row,) = rows
    assert row["backend"] == "xla" and row["within"] and row["rel_error"] < 1e-5
    assert not row["kernel_ran"]  # the stand-in is not cuDNN, and the proof says so
