"""The base of every config section, and the error a recipe that cannot run raises."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator


class ConfigError(ValueError):
    """A recipe that cannot run; the message names each bad field and how to fix it."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True,
                              allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _no_bool_for_numbers(cls, data: Any) -> Any:
        """`num_steps: true` is a typo, not 1 (pydantic would take a bool as a number)."""
        if isinstance(data, dict):
            for name, value in data.items():
                field = cls.model_fields.get(name)
                if field is not None and field.annotation in (int, float) and isinstance(value, bool):
                    raise ValueError(f"{name}: expected a number, got {value!r}")
        return data
