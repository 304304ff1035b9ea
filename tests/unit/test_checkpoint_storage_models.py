import json
import shutil

import pytest

from miles_core.config import ModelConfig
from miles_core.storage import checkpoint as ckpt
from miles_core.storage.models import ModelSourceError, materialize_model, model_identity
from miles_core.storage.object_store import UploadVerificationError, download_dir, upload_dir


def _write(step_dir, payload: bytes = b"weights"):
    (step_dir / "model.safetensors").write_bytes(payload)
    (step_dir / "trainer_state.json").write_text(json.dumps({"step": 1}))


def test_manifest_written_last_and_verified(tmp_path):
    path = ckpt.write_checkpoint(tmp_path, 10, "abc", _write)
    manifest = json.loads((path / "MANIFEST.json").read_text())
    assert manifest["step"] == 10 and manifest["config_digest"] == "abc"
    assert set(manifest["files"]) == {"model.safetensors", "trainer_state.json"}
    assert ckpt.verify_checkpoint(path) is None
    assert ckpt.latest_complete_checkpoint(tmp_path) == (10, path)


def test_corrupt_or_partial_checkpoints_are_skipped(tmp_path, caplog):
    good = ckpt.write_checkpoint(tmp_path, 10, "abc", _write)
    truncated = ckpt.write_checkpoint(tmp_path, 20, "abc", _write)
    (truncated / "model.safetensors").write_bytes(b"wei")
    flipped = ckpt.write_checkpoint(tmp_path, 25, "abc", _write)
    weights = bytearray((flipped / "model.safetensors").read_bytes())
    weights[-1] ^= 1  # same size, one bit off: only the sha256 can tell
    (flipped / "model.safetensors").write_bytes(bytes(weights))
    assert ckpt.verify_checkpoint(flipped) == "model.safetensors sha256 mismatch"
    partial = tmp_path / "step_000030"
    partial.mkdir()
    _write(partial)  # no manifest: a write that died
    assert ckpt.latest_complete_checkpoint(tmp_path) == (10, good)
    assert "skipping checkpoint" in caplog.text and "no MANIFEST" in caplog.text
    ckpt.discard_after(tmp_path, 10)
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [10]


def test_prune_keeps_latest(tmp_path):
    for step in (1, 2, 3):
        ckpt.write_checkpoint(tmp_path, step, "x", _write)
    ckpt.prune(tmp_path, keep_latest=2)
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [2, 3]


def test_upload_verifies_and_round_trips(tmp_path, monkeypatch):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "a.bin").write_bytes(b"a" * 1000)
    (src / "sub" / "b.json").write_text("{}")
    dest = (tmp_path / "store" / "runs" / "k").as_uri()
    files = upload_dir(src, dest)
    assert files["a.bin"]["size"] == 1000 and "sub/b.json" in files
    back = download_dir(dest, tmp_path / "back")
    assert (back / "a.bin").read_bytes() == b"a" * 1000

    import miles_core.storage.object_store as storage

    monkeypatch.setattr(storage, "_remote_sha256", lambda fs, path: "0" * 64)
    with pytest.raises(UploadVerificationError):
        upload_dir(src, dest)


def test_model_sources_local_url_and_errors(tmp_path, tiny_model_dir):
    local_dir, identity = materialize_model(ModelConfig(source=str(tiny_model_dir)), tmp_path / "cache")
    assert local_dir == tiny_model_dir.resolve() and identity.startswith("local:")
    url = tiny_model_dir.resolve().as_uri()
    fetched, url_identity = materialize_model(ModelConfig(source=url), tmp_path / "cache")
    assert (fetched / "config.json").is_file() and url_identity.startswith("url:")
    again, _ = materialize_model(ModelConfig(source=url), tmp_path / "cache")
    assert again == fetched  # content-addressed: reused, not fetched twice
    with pytest.raises(ModelSourceError, match="does not exist"):
        model_identity(ModelConfig(source=str(tmp_path / "missing")))
    with pytest.raises(ModelSourceError, match="no config.json"):
        materialize_model(ModelConfig(source=str(tmp_path)), tmp_path / "cache")


def test_builtin_identity_tracks_shape():
    small = ModelConfig(tiny={"hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2})
    assert model_identity(ModelConfig()) == model_identity(ModelConfig())
    assert model_identity(small) != model_identity(ModelConfig())


def test_hf_source_goes_through_huggingface_hub(tmp_path, tiny_model_dir, monkeypatch):
    """hf://org/repo@rev resolved by huggingface_hub from a local hub cache (offline mode)."""
    revision = "0123456789abcdef0123456789abcdef01234567"
    snapshot = tmp_path / "hub" / "models--acme--tiny" / "snapshots" / revision
    shutil.copytree(tiny_model_dir, snapshot)
    refs = tmp_path / "hub" / "models--acme--tiny" / "refs"
    refs.mkdir()
    (refs / "main").write_text(revision)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    import huggingface_hub.constants as hub_constants

    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    model_dir, identity = materialize_model(ModelConfig(source="hf://acme/tiny@main"), tmp_path / "cache")
    assert identity == "hf:acme/tiny@main"
    assert (model_dir / "model.safetensors").read_bytes() == (tiny_model_dir / "model.safetensors").read_bytes()
