"""A model store that accepts connections but never answers fails the stage within the
configured timeout instead of hanging it."""

import socket
import threading
import time

import pytest

from miles_core.config import ModelConfig, build_config
from miles_core.storage.models import materialize_model


@pytest.fixture
def black_hole(monkeypatch):
    """An endpoint that accepts TCP connections and never sends a byte."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    held, stop = [], threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{server.getsockname()[1]}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    yield
    stop.set()
    thread.join()
    for conn in held:
        conn.close()
    server.close()


@pytest.mark.timeout(90)
def test_a_silent_s3_model_source_times_out(black_hole, tmp_path):
    model = ModelConfig(source="s3://models/qwen3", request_timeout_seconds=1.0)
    started = time.monotonic()
    with pytest.raises(Exception, match="(?i)timeout|timed out"):
        materialize_model(model, tmp_path)
    assert time.monotonic() - started < 30
    assert not list(tmp_path.iterdir())  # nothing written


@pytest.mark.timeout(90)
def test_prefect_results_on_a_silent_store_time_out(black_hole):
    from tasks.artifacts import result_block

    cfg = build_config({"storage": {"object_store_uri": "s3://miles"}, "checkpoint": {"upload_timeout_seconds": 1.0}})
    started = time.monotonic()
    with pytest.raises(Exception, match="(?i)timeout|timed out"):
        result_block(cfg).write_path("probe.json", b"{}")
    assert time.monotonic() - started < 30
