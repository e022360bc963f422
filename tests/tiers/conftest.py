"""The NVMe I/O backends every conformance test runs against."""

import pytest

from kvtier.tiers import io_backends
from kvtier.tiers.io_backends import PosixBackend, kvikio_status, select_backend


def _backends():
    ok, why = kvikio_status()
    no_c = pytest.mark.skipif(io_backends._blockio is None, reason="the compiled loop is not built")
    return ["posix", pytest.param("posix-python", marks=no_c),
            pytest.param("kvikio", marks=pytest.mark.skipif(not ok, reason=why))]


@pytest.fixture(params=_backends())
def backend(request):
    """posix-python: the posix backend as where its compiled share loop is not built."""
    python = request.param == "posix-python"
    be = PosixBackend(threads=4, compiled=False) if python else select_backend(request.param, threads=4)
    yield be
    be.shutdown()
