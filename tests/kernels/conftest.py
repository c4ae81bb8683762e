"""The kernel tests share the quantizer tests' `arithmetic` fixture (tests/quant/conftest.py):
Pallas's interpreter lowers a kernel's operations with JAX's ordinary lowering rules, so the
emulated GPU arithmetic reaches inside the kernels (test_interpreter_sees_emulated_arithmetic)."""

from quant.conftest import arithmetic  # noqa: F401
