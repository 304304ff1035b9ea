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
        """`num_steps: true` is a typo, not 1 (pydantic would take a bool as a number). It is
        handed on as the text "true", which the field's own validation refuses, so the error
        names the field with its section (training.num_steps), where one raised here would
        name the section only."""
        if isinstance(data, dict):
            return {name: str(value).lower() if _is_number(cls.model_fields.get(name)) and isinstance(value, bool)
                    else value for name, value in data.items()}
        return data


def _is_number(field: Any) -> bool:
    return field is not None and field.annotation in (int, float)
