"""What counts as a secret, and how it is hidden: one rule for config fields (MLflow params,
`config.resolved.json`), flow parameters (the deployment schema, `miles run --set`), run
summaries and the stack's env file.

A name is secret when, lowercased, it contains one of SECRET_STEMS (so any case, camelCase and
suffixes: AUTH_TOKEN, HF_TOKEN, Password, accessToken, clientSecret, dbPassword, X-Api-Key,
aws_secret_access_key, Authorization), or when one of its words (split at _ - . spaces and
camelCase humps) is `key`, `keys` or `sig`. Counts such as `max_new_tokens` and the tokenizer
are not secrets, nor is a `*_env` field (it names an environment variable, not its value).

In free text (URLs, commands) the value of a secret-named `name=value` (a query parameter, an
assignment, `--flag=value`), `--flag value` or `Header: value`, and a URL's `user:password@`,
are replaced.
"""

from __future__ import annotations

import re
from typing import Any

REDACTED = "<redacted>"

# Regex fragments over a lowercased name. "token" is not followed by "s" (a count) or "iz"
# (the tokenizer); api/access key may be written with a separator or none.
SECRET_STEMS = (r"token(?!s|iz)", "secret", "passw", "pwd", "passphrase", "credential", "private", "auth",
                r"api[_.\-]?key", r"access[_.\-]?key", "signature", "cookie")
SECRET_WORDS = frozenset({"key", "keys", "sig"})
# The schema's own fields that have such a word and hold no secret.
NOT_SECRET = frozenset({"num_key_value_heads", "prompt_key", "label_key", "solution_key"})

_STEM = re.compile("|".join(SECRET_STEMS))
_WORD = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z0-9]+")
_USERINFO = re.compile(r"(://)[^/@\s]+@")
# A name, its separator and (looked ahead, not consumed: a value may hold a further
# assignment, as in `--header X-Token=abc`) its value.
_ASSIGNMENT = re.compile(r"(?P<name>-{0,2}[A-Za-z0-9_.\-]+)(?P<sep>=|:[ \t]+|[ \t]+)"
                         r"(?=(?P<value>(?:(?:Bearer|Basic|Token)[ \t]+)?[^\s'\"&;,]+))")


def is_secret_name(name: str) -> bool:
    if name in NOT_SECRET or name.endswith("_env"):
        return False
    words = {w.lower() for part in re.split(r"[^A-Za-z0-9]+", name) for w in _WORD.findall(part)}
    return bool(_STEM.search(name.lower()) or words & SECRET_WORDS)


def redact_text(text: str) -> str:
    """text with URL userinfo and the values of secret-named assignments, flags and headers
    replaced (`https://h/m?api_key=<redacted>`, `--header X-Token=<redacted>`)."""
    text = _USERINFO.sub(rf"\1{REDACTED}@", text)
    spans = []
    for found in _ASSIGNMENT.finditer(text):
        name, sep = found["name"], found["sep"]
        if sep.strip() == "" and not name.startswith("-"):
            continue  # `word word` is prose; only a `--flag value` pairs by a space
        if is_secret_name(name.lstrip("-")):
            spans.append(found.span("value"))
    for start, end in reversed(spans):
        text = text[:start] + REDACTED + text[end:]
    return text


def redact(value: Any, name: str = "", by_name: bool = True) -> Any:
    """A copy with secrets replaced by REDACTED: the values of secret-looking field names (at
    any depth, inside lists too; not with by_name=False, for trees whose names are not
    config fields) and secrets inside strings (redact_text)."""
    if isinstance(value, dict):
        return {k: redact(v, str(k), by_name) for k, v in value.items()}
    if isinstance(value, list):
        return [redact(v, name, by_name) for v in value]
    if by_name and value and is_secret_name(name):
        return REDACTED
    if isinstance(value, str):
        return redact_text(value)
    return value


def _any_case(fragment: str) -> str:
    """A regex fragment matching in any case without inline flags (JSON Schema patterns are
    ECMA-262, which has none)."""
    return "".join(f"[{c.lower()}{c.upper()}]" if c.isalpha() else c for c in fragment)


_STEMS_ANY_CASE = "(" + "|".join(_any_case(s) for s in SECRET_STEMS) + ")"
_NAME_CHARS = r"[A-Za-z0-9_.\-]*"
# What a flow parameter override (`dotted.key=value`) must never hold, as JSON Schema patterns
# (searched, not anchored): URL userinfo; a secret-named key (a `*_env` field names a variable);
# a secret-named assignment, header or flag inside the value (query strings, commands).
SECRET_OVERRIDE_PATTERNS = (
    r"://[^/@\s]+@",
    rf"^(?![^=]*_env=)[^=]*{_STEMS_ANY_CASE}",
    rf"=.*{_NAME_CHARS}{_STEMS_ANY_CASE}{_NAME_CHARS}(=|:[ \t])",
    rf"=(.*\s)?--?{_NAME_CHARS}{_STEMS_ANY_CASE}{_NAME_CHARS}[ \t]",
)


def secret_in_override(override: str) -> bool:
    """Whether a `dotted.key=value` override matches SECRET_OVERRIDE_PATTERNS (what the
    deployment schema refuses)."""
    return any(re.search(pattern, override) for pattern in SECRET_OVERRIDE_PATTERNS)
