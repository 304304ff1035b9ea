import pytest

from tests.unit.test_sglang_shapes import FakeSGLang


@pytest.fixture
def fake():
    """A stdlib HTTP server answering as SGLang does (see FakeSGLang)."""
    server = FakeSGLang()
    yield server
    server.server.shutdown()
    server.server.server_close()
