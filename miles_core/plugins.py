"""User code a recipe names by dotted path (`package.module:function`): custom generation,
per-sample rewards and sample / group filters. Each point has a fixed signature, checked when
the recipe is validated (`miles plan`, the flow's preflight) and again when a run loads it, so a
bad path or signature fails before anything runs, naming the field."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any

# field -> the parameters its function is called with, in order
SIGNATURES: dict[str, tuple[str, ...]] = {
    "rollout.generate": ("ctx", "prompt", "sampling_params"),
    "rollout.reward": ("response", "label"),
    "rollout.sample_filter": ("sample",),
    "rollout.group_filter": ("samples",),
}


def load_plugin(path: str, field: str, params: tuple[str, ...] | None = None) -> Callable[..., Any]:
    """The function at `path`, checked to take `params` (default: SIGNATURES[field]); errors name field."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{field}: expected 'package.module:function', got {path!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"{field}: cannot import {module_name!r} ({exc}); is its package installed or on "
                         "PYTHONPATH where the run's driver runs?") from None
    except Exception as exc:  # noqa: BLE001 - user code failing at import: reported on the field
        raise ValueError(f"{field}: importing {module_name!r} failed: {type(exc).__name__}: {exc}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"{field}: {module_name!r} has no function {attr!r}")
    params = SIGNATURES[field] if params is None else params
    try:
        inspect.signature(fn).bind(*params)
    except TypeError as exc:
        raise ValueError(f"{field}: {path} must take ({', '.join(params)}): {exc}") from None
    except ValueError:  # no introspectable signature (a builtin): trust it
        pass
    return fn


def load_optional(path: str | None, field: str) -> Callable[..., Any] | None:
    return None if path is None else load_plugin(path, field)
