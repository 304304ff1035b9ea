"""Reading recipes: YAML, dotted `--set` overrides, validation errors that say how to fix
the input, and the field reference `miles plan --fields` prints."""

from __future__ import annotations

import json
import typing
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import BaseModel, Field, ValidationError

from miles_core.config.base import ConfigError
from miles_core.config.schema import RunConfig
from miles_core.tracking.redaction import SECRET_OVERRIDE_PATTERNS


class RecipeLoader(yaml.SafeLoader):
    """YAML as a recipe should be: a key written twice is an error (not "last one wins"), and
    anchors/aliases are refused (a few hundred bytes of nested aliases expand to gigabytes)."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            raise yaml.constructor.ConstructorError(None, None, "aliases (*name) are not allowed in recipes",
                                                    self.peek_event().start_mark)
        return super().compose_node(parent, index)

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"key {key!r} is written twice",
                                                        key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _set_dotted(tree: dict[str, Any], dotted_key: str, value: Any) -> None:
    node = tree
    *parents, leaf = dotted_key.split(".")
    for part in parents:
        child = node.setdefault(part, {})
        if isinstance(child, str):  # a variant written as its kind alone (`loop: fully_async`)
            child = node[part] = {"kind": child}
        if not isinstance(child, dict):
            raise ConfigError(f"--set {dotted_key}: '{part}' is a value, not a section")
        node = child
    node[leaf] = value


def parse_overrides(overrides: list[str]) -> list[tuple[str, Any]]:
    """`a.b=1` -> ("a.b", 1); values are parsed as YAML scalars (numbers, bools, null, lists)."""
    parsed = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set {item!r}: expected dotted.key=value, e.g. training.lr=1e-4")
        try:
            value = yaml.load(raw, Loader=RecipeLoader) if raw.strip() else ""
        except yaml.YAMLError as exc:
            raise ConfigError(f"--set {item!r}: the value is not valid YAML ({exc.problem or exc}); quote strings, "
                              "e.g. --set 'rollout.reward=\"my_module:score\"'") from None
        parsed.append((key.strip(), value))
    return parsed


def _explain(exc: ValidationError, source: str) -> str:
    lines = [f"invalid config ({source}):"]
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "<root>"
        if err["type"] == "union_tag_not_found":
            lines.append(f"  {where}: which kind? set {where}.kind, or write {where}: <kind> (the kinds and their "
                         "fields: `miles plan --fields`)")
            continue
        if err["type"] == "extra_forbidden":
            lines.append(f"  {where}: unknown field; remove it or check the spelling (see `miles plan --fields`)")
            continue
        got = f" (got {err['input']!r})" if not isinstance(err.get("input"), dict) else ""
        lines.append(f"  {where}: {err['msg']}{got}")
    return "\n".join(lines)


def build_config(tree: dict[str, Any], overrides: list[str] = (), source: str = "<dict>") -> RunConfig:
    """Validate a config tree after applying dotted overrides."""
    tree = json.loads(json.dumps(tree or {}))
    for key, value in parse_overrides(list(overrides)):
        _set_dotted(tree, key, value)
    try:
        return RunConfig.model_validate(tree)
    except ValidationError as exc:
        raise ConfigError(_explain(exc, source)) from None


# What a flow parameter must never hold, as JSON Schema (the `overrides` items of a deployment's
# parameter schema): Prefect's server validates a run's parameters against it before it stores
# them, so a secret passed by `prefect deployment run --param` is refused instead of kept in its
# database. Secrets come from the environment; no config field holds one.
Override = Annotated[str, Field(pattern=r"^[^=]+=", json_schema_extra={
    "not": {"anyOf": [{"pattern": p} for p in SECRET_OVERRIDE_PATTERNS]}})]
"""A `dotted.key=value` override as a flow parameter."""


def load_config(path: str | Path, overrides: list[str] = ()) -> RunConfig:
    """Read a YAML recipe, apply `--set` overrides, validate."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        tree = yaml.load(path.read_text(encoding="utf-8"), Loader=RecipeLoader)
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config {path} is not UTF-8 text: {exc.reason} at byte {exc.start}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"config {path} is not valid YAML: {exc}") from None
    if tree is None:
        raise ConfigError(f"config {path} is empty: an empty recipe would silently run every default; "
                          "start from configs/local.yaml")
    if not isinstance(tree, dict):
        raise ConfigError(f"config {path} must be a mapping of sections, got {type(tree).__name__}")
    return build_config(tree, overrides, source=str(path))


def field_docs(model: type[BaseModel] = RunConfig, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted name, default, docstring) for every leaf field: the config reference."""
    rows = []
    for name, info in model.model_fields.items():
        dotted = f"{prefix}{name}"
        annotation = info.annotation
        options = _variant_models(annotation)
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            rows.extend(field_docs(annotation, dotted + "."))
        elif options:
            kinds = " | ".join(m.model_fields["kind"].default for m in options)
            rows.append((f"{dotted}.kind", repr(info.default.kind), f"one of {kinds}. " + _doc(info)))
            for variant in options:
                for name_, default, doc in field_docs(variant, dotted + "."):
                    if not name_.endswith(".kind"):
                        rows.append((name_, default, f"({variant.model_fields['kind'].default} only) {doc}"))
        else:
            rows.append((dotted, repr(info.default), _doc(info)))
    return rows


def _doc(info) -> str:
    return " ".join((info.description or "").split())


def _variant_models(annotation: Any) -> list[type[BaseModel]]:
    """The models of a `variants(...)` field (a discriminated union), else []."""
    models = [arg for arg in typing.get_args(annotation)
              if isinstance(arg, type) and issubclass(arg, BaseModel) and "kind" in arg.model_fields]
    return models if len(models) == len(typing.get_args(annotation)) else []
