"""What a run needs from the outside world, checked before anything of the run is written.

`preflight(cfg)` is the first thing `miles plan`, `miles run` and the flow do: the model
source, every data file (each row), reward functions, lengths against the model, and the
object store. All problems are reported at once, each naming the field to fix; remote
checks have short timeouts. Nothing here writes a file, starts Ray or opens an MLflow run.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

from miles_core.config import ConfigError, RunConfig
from miles_core.data import jsonl_lines, row_problem
from miles_core.plugins import load_optional
from miles_core.rewards import get_reward
from miles_core.storage.models import local_source_dir

REMOTE_TIMEOUT_SECONDS = 15.0


class PreflightError(ConfigError):
    """The recipe is valid but its inputs are not there or not usable."""


def preflight(cfg: RunConfig) -> None:
    """PreflightError listing every problem found; returns None when the run can start."""
    problems = [*_model_problems(cfg), *_data_problems(cfg), *_reward_problems(cfg), *_store_problems(cfg)]
    if problems:
        raise PreflightError("the run cannot start:\n" + "\n".join(f"  {p}" for p in problems))


# ---- model ----------------------------------------------------------------------------------------
def _model_problems(cfg: RunConfig) -> Iterator[str]:
    source = cfg.model.source
    local = local_source_dir(source)
    if source.startswith("builtin:"):
        positions = cfg.model.tiny.max_positions
    elif source.startswith("hf://"):
        yield from _hub_problems(source)
        return
    elif local is None:
        yield from _remote_dir_problems("model.source", source)
        return
    else:
        config_path = local / "config.json"
        if not config_path.parent.is_dir():
            yield f"model.source: directory {config_path.parent} does not exist"
            return
        if not config_path.is_file():
            yield f"model.source: {config_path.parent} has no config.json (expected a Hugging Face model directory)"
            return
        try:
            model_config = json.loads(config_path.read_text(encoding="utf-8"))
            positions = int(model_config.get("max_position_embeddings", 0)) or None
        except (UnicodeDecodeError, json.JSONDecodeError, AttributeError, TypeError, ValueError) as exc:
            yield f"model.source: {config_path} is not a valid config.json ({exc})"
            return
    new_tokens = max(cfg.rollout.max_new_tokens, cfg.eval.max_new_tokens)
    if positions is not None and new_tokens >= positions:
        yield (f"rollout.max_new_tokens / eval.max_new_tokens: {new_tokens} new tokens do not fit the model's "
               f"{positions} positions with any prompt; lower them")


def _hub_problems(source: str) -> Iterator[str]:
    from huggingface_hub import HfApi

    repo, _, revision = source[len("hf://"):].partition("@")
    try:
        HfApi().repo_info(repo, revision=revision or None, timeout=REMOTE_TIMEOUT_SECONDS)
    except Exception as exc:  # noqa: BLE001 - HTTP errors, the HTTP client's timeouts, refused connections
        yield f"model.source: {source} is not reachable on the Hub ({type(exc).__name__}: {str(exc)[:200]})"


def _remote_dir_problems(field: str, uri: str) -> Iterator[str]:
    from miles_core.storage.object_store import filesystem, s3_bucket_problem

    try:
        fs, root = filesystem(uri, REMOTE_TIMEOUT_SECONDS)
        # exists() is False for any S3 failure: ask the bucket first, for the real reason
        problem = s3_bucket_problem(fs, root.split("/", 1)[0]) if uri.startswith(("s3://", "s3a://")) else None
        if problem:
            yield f"{field}: {uri}: {problem}"
        elif not fs.exists(root):
            yield f"{field}: {uri} does not exist"
    except Exception as exc:  # noqa: BLE001 - any failure to reach the store is the finding
        yield f"{field}: {uri} is not reachable ({type(exc).__name__}: {str(exc)[:200]})"


# ---- data -----------------------------------------------------------------------------------------
def _data_problems(cfg: RunConfig) -> Iterator[str]:
    files = [("data.train_path", cfg.data.train_path), ("data.eval_path", cfg.data.eval_path),
             *[(f"eval.datasets[{d.name}].path", d.path) for d in cfg.eval.datasets]]
    for field, path in files:
        if path is not None:
            yield from _file_problems(field, Path(path).expanduser(), cfg.data.prompt_key, cfg.data.label_key)


def _file_problems(field: str, path: Path, prompt_key: str, label_key: str, max_reported: int = 5) -> Iterator[str]:
    if not path.is_file():
        yield f"{field}: {path} does not exist"
        return
    found, rows = 0, 0
    try:
        for line_no, line in jsonl_lines(path):
            rows += 1
            problem = row_problem(line, prompt_key, label_key)
            if problem is not None and found < max_reported:
                yield f"{field}: {path}:{line_no}: {problem}"
            found += problem is not None
    except ValueError as exc:  # a line that is not UTF-8: it names the file and line
        yield f"{field}: {exc}"
        return
    if found > max_reported:
        yield f"{field}: {path}: {found - max_reported} more bad rows"
    if rows == 0:
        yield f"{field}: {path} has no rows"


# ---- rewards and the store ------------------------------------------------------------------------
def _reward_problems(cfg: RunConfig) -> Iterator[str]:
    """Rewards and the other plugin points (miles_core.plugins): importable, right signature."""
    names = [("rollout.reward", cfg.rollout.reward),
             *[(f"eval.datasets[{d.name}].reward", d.reward) for d in cfg.eval.datasets if d.reward]]
    for field, name in names:
        try:
            get_reward(name, field)
        except ValueError as exc:
            yield str(exc)
    remote = cfg.rollout.remote_reward
    if remote is not None and remote.api_key_env and not os.environ.get(remote.api_key_env):
        yield f"rollout.remote_reward.api_key_env: ${remote.api_key_env} is not set in this environment"
    for field in ("rollout.generate", "rollout.sample_filter", "rollout.group_filter"):
        try:
            load_optional(getattr(cfg.rollout, field.split(".")[1]), field)
        except ValueError as exc:
            yield str(exc)


def _store_problems(cfg: RunConfig) -> Iterator[str]:
    uri = cfg.storage.store_uri()
    if uri.startswith(("s3://", "s3a://")):
        bucket = uri.split("://", 1)[1].split("/", 1)[0]
        yield from _remote_dir_problems("storage.object_store_uri", f"s3://{bucket}")
