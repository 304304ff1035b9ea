"""The base of every config section, and the error a recipe that cannot run raises."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class ConfigError(ValueError):
    """A recipe that cannot run; the message names each bad field and how to fix it."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)
