"""Object-store access through fsspec (file://, s3:// via s3fs, ...): verified uploads."""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from pathlib import Path

import fsspec

from miles_core.errors import InfrastructureError
from miles_core.storage.checkpoint import sha256_file

# botocore's own per-request retries (5xx, throttling, connection errors, timeouts) stay on
# but few: callers retry whole files with backoff, and with more inner attempts a hung
# server would hold one request for attempts x timeout before the caller hears of it.
S3_REQUEST_ATTEMPTS = 2


class UploadVerificationError(InfrastructureError, IOError):
    """The stored object differs from the local file (size or sha256)."""


def write_private_text(path: str | Path, text: str) -> None:
    """Write text to a file only its owner can read (0600), whatever mode it had: open with
    O_CREAT sets the mode of a new file only, so an existing one is changed before any text
    is written."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        os.fchmod(fd, 0o600)
        fh.write(text)


def filesystem(uri: str, timeout_seconds: float | None = None) -> tuple[fsspec.AbstractFileSystem, str]:
    """The filesystem and path of uri. With timeout_seconds, S3 requests get connect/read
    timeouts and bounded inner retries, on an instance of their own (fsspec caches instances
    by arguments, and the endpoint/credentials come from the environment at creation)."""
    if timeout_seconds is None or not uri.startswith(("s3://", "s3a://")):
        return fsspec.core.url_to_fs(uri)
    fs, path = fsspec.core.url_to_fs(uri, **s3_settings(timeout_seconds))
    return bounded_retries(fs), path


def s3_settings(timeout_seconds: float) -> dict:
    """s3fs constructor settings: botocore connect/read timeouts and bounded retries for each
    request, on an instance of its own."""
    return {"config_kwargs": {"connect_timeout": timeout_seconds, "read_timeout": timeout_seconds,
                              "retries": {"max_attempts": S3_REQUEST_ATTEMPTS, "mode": "standard"}},
            "skip_instance_cache": True}


def bounded_retries(fs: fsspec.AbstractFileSystem) -> fsspec.AbstractFileSystem:
    """s3fs's own retry loop on top of botocore's: off (see S3_REQUEST_ATTEMPTS)."""
    fs.retries = 1
    return fs


def _is_s3(fs: fsspec.AbstractFileSystem) -> bool:
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    return "s3" in protocols


def s3_bucket_problem(fs: fsspec.AbstractFileSystem, bucket: str) -> str | None:
    """What keeps `fs` from using an S3 bucket (None when nothing does), from the request's own
    error: s3fs's exists() answers False whatever failed, so a store without credentials, or
    with refused ones, was reported as a missing bucket. Network failures propagate."""
    from botocore.exceptions import NoCredentialsError, PartialCredentialsError

    try:
        fs.call_s3("head_bucket", Bucket=bucket)
    except (NoCredentialsError, PartialCredentialsError) as exc:
        return (f"no usable S3 credentials ({exc}): set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
                "(or AWS_PROFILE) in the environment that runs this (`source <state dir>/env` for the local stack)")
    except PermissionError as exc:
        return (f"the S3 credentials were refused for bucket {bucket} ({exc}): check AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY, and that they may read and write the bucket")
    except FileNotFoundError:
        return f"bucket {bucket} does not exist: create it (`aws s3 mb s3://{bucket}`) or name another"
    return None


def _remote_sha256(fs: fsspec.AbstractFileSystem, path: str, chunk_bytes: int = 8 << 20) -> str:
    digest = hashlib.sha256()
    with fs.open(path, "rb") as fh:
        while block := fh.read(chunk_bytes):
            digest.update(block)
    return digest.hexdigest()


def upload_file(fs: fsspec.AbstractFileSystem, local_path: str | Path, remote_path: str,
                part_bytes: int | None = None) -> dict:
    """Copy one file, then read it back and compare size and sha256; returns {size, sha256}.

    On S3, files of at least 2 x part_bytes go up as a multipart upload of part_bytes parts
    (s3fs aborts the multipart upload when a part fails, so no half object is left)."""
    local_path = Path(local_path)
    size, sha = local_path.stat().st_size, sha256_file(local_path)
    fs.makedirs(remote_path.rsplit("/", 1)[0], exist_ok=True)
    if _is_s3(fs) and part_bytes:
        fs.put_file(str(local_path), remote_path, chunksize=part_bytes)
    else:
        fs.put_file(str(local_path), remote_path)
    remote_size = fs.info(remote_path)["size"]
    if remote_size != size:
        raise UploadVerificationError(f"{remote_path}: stored {remote_size} bytes, local {size}")
    if _remote_sha256(fs, remote_path) != sha:
        raise UploadVerificationError(f"{remote_path}: stored sha256 differs from the local file")
    return {"size": size, "sha256": sha}


def upload_dir(local_dir: str | Path, dest_uri: str, timeout_seconds: float | None = None,
               part_bytes: int | None = None) -> dict[str, dict]:
    """Copy every file of local_dir under dest_uri, then read each back and compare.

    Returns {relative path: {size, sha256}}. Raises UploadVerificationError on mismatch.
    """
    local_dir = Path(local_dir)
    fs, root = filesystem(dest_uri, timeout_seconds)
    uploaded = {}
    for path in sorted(p for p in local_dir.rglob("*") if p.is_file()):
        rel = path.relative_to(local_dir).as_posix()
        uploaded[rel] = upload_file(fs, path, f"{root.rstrip('/')}/{rel}", part_bytes)
    return uploaded


def read_json(fs: fsspec.AbstractFileSystem, path: str) -> dict | None:
    """The JSON object at path, or None when there is none."""
    try:
        with fs.open(path, "rb") as fh:
            return json.loads(fh.read())
    except FileNotFoundError:
        return None


def write_json_atomic(fs: fsspec.AbstractFileSystem, path: str, data: dict) -> None:
    """Write a small JSON object so that readers see the old or the new one, never a torn
    one: write a temporary object, check it, move it over (a rename locally, an atomic
    server-side copy on S3), then read the result back."""
    body = json.dumps(data, indent=1).encode()
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    try:
        fs.pipe_file(tmp, body)
        if fs.cat_file(tmp) != body:
            raise UploadVerificationError(f"{tmp}: read back differs from what was written")
        fs.mv(tmp, path)
    except BaseException:
        remove_quietly(fs, tmp)
        raise
    if fs.cat_file(path) != body:
        raise UploadVerificationError(f"{path}: read back differs from what was written")


def remove_quietly(fs: fsspec.AbstractFileSystem, path: str, recursive: bool = False) -> None:
    """Best-effort cleanup: a store that is failing must not hide the error being raised."""
    try:
        fs.rm(path, recursive=recursive)
    except Exception:  # noqa: BLE001 - cleanup only; the object may not exist
        pass


def download_dir(src_uri: str, local_dir: str | Path, timeout_seconds: float | None = None) -> Path:
    """Copy a remote directory tree to local_dir. A key that would land outside local_dir
    (`..` parts, an absolute path) is refused before anything is written."""
    fs, root = filesystem(src_uri, timeout_seconds)
    if not fs.exists(root):
        raise FileNotFoundError(f"{src_uri} does not exist")
    local_dir = Path(local_dir).resolve()
    remotes = fs.find(root)
    targets = [local_dir / remote[len(root.rstrip("/")) + 1:] for remote in remotes]
    escaping = [str(t) for t in targets if not t.resolve().is_relative_to(local_dir)]
    if escaping:
        raise ValueError(f"{src_uri} holds keys that escape {local_dir}: {escaping[:3]}; refusing to download")
    local_dir.mkdir(parents=True, exist_ok=True)
    for remote, target in zip(remotes, targets):
        target.parent.mkdir(parents=True, exist_ok=True)
        fs.get_file(remote, str(target))
    return local_dir


def join_uri(base: str, *parts: str) -> str:
    return "/".join([base.rstrip("/"), *[p.strip("/") for p in parts]])
