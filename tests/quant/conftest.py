"""The `arithmetic` fixture: run a module's tests under IEEE float32 arithmetic and again under
the arithmetic a GPU backend may legally use (faithfully rounded division, FMA contraction).

A module opts in with `pytestmark = pytest.mark.usefixtures("arithmetic")`; every bit-exactness
test then runs twice and must give the same bits both times.
"""

import pytest

from backend_arithmetic import ARITHMETIC_MODES


@pytest.fixture(scope="module", params=sorted(ARITHMETIC_MODES))
def arithmetic(request):
    with ARITHMETIC_MODES[request.param]():
        yield request.param
