"""Object-store access through fsspec (file://, s3:// via s3fs, ...): verified uploads."""

from __future__ import annotations

import hashlib
from pathlib import Path

import fsspec

from miles_core.checkpoint import sha256_file


class UploadVerificationError(IOError):
    """The stored object differs from the local file (size or sha256)."""


def filesystem(uri: str) -> tuple[fsspec.AbstractFileSystem, str]:
    fs, path = fsspec.core.url_to_fs(uri)
    return fs, path


def _remote_sha256(fs: fsspec.AbstractFileSystem, path: str, chunk_bytes: int = 8 << 20) -> str:
    digest = hashlib.sha256()
    with fs.open(path, "rb") as fh:
        while block := fh.read(chunk_bytes):
            digest.update(block)
    return digest.hexdigest()


def upload_dir(local_dir: str | Path, dest_uri: str) -> dict[str, dict]:
    """Copy every file of local_dir under dest_uri, then read each back and compare.

    Returns {relative path: {size, sha256}}. Raises UploadVerificationError on mismatch.
    """
    local_dir = Path(local_dir)
    fs, root = filesystem(dest_uri)
    uploaded = {}
    for path in sorted(p for p in local_dir.rglob("*") if p.is_file()):
        rel = path.relative_to(local_dir).as_posix()
        remote = f"{root.rstrip('/')}/{rel}"
        fs.makedirs(remote.rsplit("/", 1)[0], exist_ok=True)
        fs.put_file(str(path), remote)
        size, sha = path.stat().st_size, sha256_file(path)
        remote_size = fs.info(remote)["size"]
        if remote_size != size or _remote_sha256(fs, remote) != sha:
            raise UploadVerificationError(f"{remote}: stored {remote_size} bytes, local {size} (or sha256 differs)")
        uploaded[rel] = {"size": size, "sha256": sha}
    return uploaded


def download_dir(src_uri: str, local_dir: str | Path) -> Path:
    """Copy a remote directory tree to local_dir."""
    fs, root = filesystem(src_uri)
    if not fs.exists(root):
        raise FileNotFoundError(f"{src_uri} does not exist")
    local_dir = Path(local_dir)
    local_dir.mkdir(parents=True, exist_ok=True)
    for remote in fs.find(root):
        rel = remote[len(root.rstrip("/")) + 1:]
        target = local_dir / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        fs.get_file(remote, str(target))
    return local_dir


def join_uri(base: str, *parts: str) -> str:
    return "/".join([base.rstrip("/"), *[p.strip("/") for p in parts]])
