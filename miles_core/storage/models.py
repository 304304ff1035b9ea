"""Model sources -> a local HF directory, each with a stable identity (the cache key).

Sources: `builtin:tiny-qwen3`, a local directory, `hf://org/repo@revision`, or any fsspec
URL (`s3://...`, `file://...`). Materialised directories are content-addressed by identity
and sealed with a marker file, so a repeated call (or a second run) reuses them.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from fsspec.implementations.local import LocalFileSystem

from miles_core.config import ModelConfig
from miles_core.storage.object_store import download_dir, filesystem

BUILTIN_VERSION = "tiny-qwen3-v1"  # bump when the built-in model's construction changes
MARKER = ".miles-complete.json"


class ModelSourceError(ValueError):
    """The model source cannot be resolved (missing path, not an HF directory, ...)."""


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _listing_identity(entries: list[tuple[str, int, str]]) -> str:
    return _digest(json.dumps(sorted(entries)))


def _check_hf_dir(path: Path, source: str) -> Path:
    if not (path / "config.json").is_file():
        raise ModelSourceError(f"model source {source!r}: {path} has no config.json; expected a Hugging Face model directory")
    return path


def local_source_dir(source: str) -> Path | None:
    """The local directory a model source names: a path, or a URL that fsspec reads from this
    machine's filesystem (file://...), so both get the same checks; None for built-in, Hub and
    remote sources."""
    if source.startswith(("builtin:", "hf://")):
        return None
    if "://" not in source:
        return Path(source).expanduser()
    if source.split("://", 1)[0] not in LocalFileSystem.protocol:
        return None  # not resolved here: a missing filesystem package is preflight's finding
    _, path = filesystem(source)  # the path fsspec would copy from
    return Path(path)


def model_identity(model: ModelConfig) -> str:
    """Identity of the artifact a source names: changes exactly when its content can."""
    src = model.source
    if src.startswith("builtin:"):
        return f"builtin:{BUILTIN_VERSION}:{_digest(model.tiny.model_dump_json())}"
    if src.startswith("hf://"):
        repo, _, revision = src[len("hf://"):].partition("@")
        return f"hf:{repo}@{revision or 'main'}"
    if "://" not in src:
        path = Path(src).expanduser().resolve()
        if not path.is_dir():
            raise ModelSourceError(f"model source {src!r}: directory {path} does not exist")
        entries = [(str(p.relative_to(path)), p.stat().st_size, str(p.stat().st_mtime_ns))
                   for p in path.rglob("*") if p.is_file()]
        return f"local:{path}:{_listing_identity(entries)}"
    fs, root = filesystem(src, model.request_timeout_seconds)
    if not fs.exists(root):
        raise ModelSourceError(f"model source {src!r} does not exist")
    entries = [(name, int(info.get("size", 0)), str(info.get("ETag") or info.get("mtime") or ""))
               for name, info in fs.find(root, detail=True).items()]
    return f"url:{src}:{_listing_identity(entries)}"


def materialize_model(model: ModelConfig, cache_dir: str | Path) -> tuple[Path, str]:
    """A local HF directory for the source (built, downloaded or referenced) and its identity."""
    identity = model_identity(model)
    src = model.source
    local = local_source_dir(src)
    if local is not None:
        _check_hf_dir(local, src)  # a file:// source too, before anything is copied
        if "://" not in src:
            return local.resolve(), identity  # a plain path is used in place
    target = Path(cache_dir) / _digest(identity)
    if (target / MARKER).is_file():
        return target, identity
    staging = target.with_suffix(".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    if src.startswith("builtin:"):
        from miles_core.tiny import build_tiny_model

        build_tiny_model(model.tiny, staging)
    elif src.startswith("hf://"):
        _download_hf(src, staging)
    else:
        download_dir(src, staging, model.request_timeout_seconds)
    _check_hf_dir(staging, src)
    (staging / MARKER).write_text(json.dumps({"identity": identity, "source": src}))
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
    return target, identity


def _download_hf(src: str, out_dir: Path) -> None:
    """Snapshot through the shared HF cache (resumable, deduplicated), then copy it out."""
    from huggingface_hub import snapshot_download

    repo, _, revision = src[len("hf://"):].partition("@")
    # Honours HF_TOKEN / HF_ENDPOINT / HF_HUB_OFFLINE from the environment; the token is never logged.
    snapshot = snapshot_download(repo_id=repo, revision=revision or None, etag_timeout=30,
                                 allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.py"])
    shutil.copytree(snapshot, out_dir, dirs_exist_ok=True, symlinks=False)
