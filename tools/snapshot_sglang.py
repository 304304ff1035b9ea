#!/usr/bin/env python
"""Static contract snapshot of SGLang's HTTP/CLI surface, taken from its source.

SGLang needs CUDA and cannot be installed here, but its PyPI wheel is (almost
all) pure Python source. This script downloads the wheel with
``pip download sglang==<v> --no-deps`` (cached in /tmp/sglang-wheels), reads
the ``.py`` members straight out of the zip, parses them with :mod:`ast`
(sglang is never imported), and writes one deterministic JSON file:

    python tools/snapshot_sglang.py --versions 0.5.16 0.5.17 0.5.23 \
        --out tests/contract/sglang_contract.json

Per version it records:

* ``server_args``  -- every option string the ``sglang serve`` argparse parser
  accepts (field-derived ``A[T, Arg(...)]`` declarations replayed the way
  ``arg_groups/arg_utils.add_cli_args_from_dataclass`` does it, plus the manual
  ``parser.add_argument`` calls in ``ServerArgs.add_cli_args``), the
  ``ServerArgs`` field names/defaults, and the parser's ``allow_abbrev``;
* ``io_structs``   -- every dataclass / msgspec Struct in
  ``sglang/srt/managers/io_struct.py`` (fields, annotation text, defaults);
* ``routes``       -- every FastAPI route in ``entrypoints/http_server.py``
  and the routers it includes;
* ``sampling_params``, ``meta_info``, ``weight_update_group_rank``,
  ``routed_experts`` and an ``rl_defaults`` digest, each finding with the
  ``file:line`` it came from.

Across versions, ``cross_version`` has one entry per ordered pair ``"A->B"``
(n versions give n*(n-1) entries; the keys are sorted in the output).

Nothing here is copied from SGLang beyond names, literal defaults and short
expression texts; help texts are reduced to a ``deprecated`` boolean.
"""

from __future__ import annotations

import argparse
import ast
import glob
import hashlib
import json
import os
import re
import subprocess
import sys
import zipfile
from collections.abc import Iterable
from typing import Any

SCHEMA_VERSION = 1
DEFAULT_CACHE = "/tmp/sglang-wheels"

# Flags an RL client (Miles-style launcher) cares about; reported per version
# with exact/prefix resolution so a test can tell "exists" from "silently
# resolves to something else".
KEY_FLAGS = [
    "--model-path",
    "--tp-size",
    "--dp-size",
    "--pp-size",
    "--ep-size",
    "--mem-fraction-static",
    "--cuda-graph-max-bs",
    "--cuda-graph-bs",
    "--disable-cuda-graph",
    "--dist-init-addr",
    "--nnodes",
    "--node-rank",
    "--moe-a2a-backend",
    "--enable-return-routed-experts",
    "--enable-deterministic-inference",
    "--api-key",
    "--weight-version",
    "--enable-dp-attention",
    "--enable-memory-saver",
    "--skip-server-warmup",
    "--host",
    "--port",
    "--base-gpu-id",
    "--load-format",
    "--trust-remote-code",
]

REQUEST_STRUCTS = [
    "GenerateReqInput",
    "UpdateWeightFromDiskReqInput",
    "UpdateWeightsFromDistributedReqInput",
    "InitWeightsUpdateGroupReqInput",
    "UpdateWeightsFromTensorReqInput",
    "UpdateWeightVersionReqInput",
    "FlushCacheReqInput",
    "PauseGenerationReqInput",
    "ContinueGenerationReqInput",
    "AbortReq",
    "GetWeightsByNameReqInput",
    "ReleaseMemoryOccupationReqInput",
    "ResumeMemoryOccupationReqInput",
    "DestroyWeightsUpdateGroupReqInput",
]

HTTP_METHODS = {"get", "post", "put", "delete", "patch", "head", "options"}


# --------------------------------------------------------------------------
# Wheel access
# --------------------------------------------------------------------------


def find_or_download_wheel(version: str, cache_dir: str, offline: bool) -> str:
    os.makedirs(cache_dir, exist_ok=True)
    pattern = os.path.join(cache_dir, f"sglang-{version}-*.whl")
    found = sorted(glob.glob(pattern))
    if not found:
        if offline:
            raise SystemExit(f"no cached wheel for sglang=={version} in {cache_dir}")
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            f"sglang=={version}",
            "--no-deps",
            "-d",
            cache_dir,
        ]
        print("+", " ".join(cmd), file=sys.stderr)
        subprocess.run(cmd, check=True)
        found = sorted(glob.glob(pattern))
    if not found:
        raise SystemExit(f"pip download did not produce {pattern}")
    return found[0]


class Wheel:
    """Read-only view of the wheel's python sources (parsed lazily)."""

    def __init__(self, path: str):
        self.path = path
        self.zf = zipfile.ZipFile(path)
        self.names = set(self.zf.namelist())
        self._cache: dict[str, Src] = {}

    def has(self, rel: str) -> bool:
        return rel in self.names

    def src(self, rel: str) -> Src | None:
        if rel not in self.names:
            return None
        if rel not in self._cache:
            text = self.zf.read(rel).decode("utf-8")
            self._cache[rel] = Src(rel, text)
        return self._cache[rel]

    def module_path(self, dotted: str) -> str | None:
        base = dotted.replace(".", "/")
        for cand in (base + ".py", base + "/__init__.py"):
            if cand in self.names:
                return cand
        return None

    def py_files(self, prefix: str) -> list[str]:
        return sorted(n for n in self.names if n.startswith(prefix) and n.endswith(".py"))


class Src:
    def __init__(self, rel: str, text: str):
        self.rel = rel
        self.text = text
        self.tree = ast.parse(text, filename=rel)
        # ast offsets are UTF-8 byte columns; ast.get_source_segment re-splits
        # the whole file per call, which is far too slow for 8k-line modules.
        self._lines = text.encode("utf-8").splitlines(keepends=True)
        self._parents: dict[int, ast.AST] | None = None

    def _segment(self, node: ast.AST) -> str | None:
        if getattr(node, "end_lineno", None) is None:
            return None
        l0, l1 = node.lineno - 1, node.end_lineno - 1
        c0, c1 = node.col_offset, node.end_col_offset
        if l0 == l1:
            b = self._lines[l0][c0:c1]
        else:
            b = self._lines[l0][c0:] + b"".join(self._lines[l0 + 1 : l1]) + self._lines[l1][:c1]
        return b.decode("utf-8", "replace")

    def enclosing_function_of_line(self, line: int) -> str | None:
        best = None
        for n in ast.walk(self.tree):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.lineno <= line <= n.end_lineno:
                if best is None or n.lineno > best.lineno:
                    best = n
        return best.name if best is not None else None

    def enclosing_function(self, node: ast.AST) -> str | None:
        if self._parents is None:
            self._parents = {}
            for parent in ast.walk(self.tree):
                for child in ast.iter_child_nodes(parent):
                    self._parents[id(child)] = parent
        cur = self._parents.get(id(node))
        while cur is not None:
            if isinstance(cur, (ast.FunctionDef, ast.AsyncFunctionDef)):
                return cur.name
            cur = self._parents.get(id(cur))
        return None

    def loc(self, node: ast.AST) -> str:
        return f"{self.rel}:{node.lineno}"

    def seg(self, node: ast.AST | None, limit: int = 300) -> str | None:
        if node is None:
            return None
        s = self._segment(node)
        if s is None:
            s = ast.unparse(node)
        s = re.sub(r"\s+", " ", s).strip()
        # Drop the trailing comma black leaves in exploded brackets.
        s = re.sub(r",\s*([\]\)\}])", r"\1", s)
        s = re.sub(r"([\[\(\{])\s+", r"\1", s)
        if len(s) > limit:
            s = s[: limit - 3] + "..."
        return s


# --------------------------------------------------------------------------
# AST helpers
# --------------------------------------------------------------------------

_NO_VALUE = object()


def const_eval(node: ast.AST | None) -> Any:
    """Evaluate a literal-ish expression; return _NO_VALUE if not literal."""
    if node is None:
        return _NO_VALUE
    if isinstance(node, ast.Constant):
        v = node.value
        if isinstance(v, (bytes, complex)) or v is Ellipsis:
            return _NO_VALUE
        return v
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        out = []
        for e in node.elts:
            v = const_eval(e)
            if v is _NO_VALUE:
                return _NO_VALUE
            out.append(v)
        if isinstance(node, ast.Set):
            try:
                return sorted(out)
            except TypeError:
                return out
        return out
    if isinstance(node, ast.Dict):
        out = {}
        for k, v in zip(node.keys, node.values):
            if k is None:
                return _NO_VALUE
            kv, vv = const_eval(k), const_eval(v)
            if kv is _NO_VALUE or vv is _NO_VALUE or not isinstance(kv, (str, int)):
                return _NO_VALUE
            out[str(kv)] = vv
        return out
    if isinstance(node, ast.UnaryOp):
        v = const_eval(node.operand)
        if v is _NO_VALUE:
            return _NO_VALUE
        if isinstance(node.op, ast.USub) and isinstance(v, (int, float)):
            return -v
        if isinstance(node.op, ast.UAdd) and isinstance(v, (int, float)):
            return +v
        if isinstance(node.op, ast.Not):
            return not v
        return _NO_VALUE
    if isinstance(node, ast.BinOp):
        a, b = const_eval(node.left), const_eval(node.right)
        if a is _NO_VALUE or b is _NO_VALUE:
            return _NO_VALUE
        if isinstance(a, str) and isinstance(b, str) and isinstance(node.op, ast.Add):
            return a + b
        if not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (a, b)):
            return _NO_VALUE
        ops = {
            ast.Add: lambda x, y: x + y,
            ast.Sub: lambda x, y: x - y,
            ast.Mult: lambda x, y: x * y,
            ast.FloorDiv: lambda x, y: x // y,
            ast.Div: lambda x, y: x / y,
            ast.LShift: lambda x, y: x << y,
            ast.Pow: lambda x, y: x**y,
        }
        fn = ops.get(type(node.op))
        if fn is None:
            return _NO_VALUE
        try:
            return fn(a, b)
        except (ArithmeticError, ValueError, OverflowError):
            return _NO_VALUE
    return _NO_VALUE


def default_repr(src: Src, node: ast.AST | None) -> dict[str, Any]:
    """{'value': literal} or {'expr': source text}; handles field(default=...)."""
    if node is None:
        return {}
    if isinstance(node, ast.Call) and dotted(node.func) in (
        "field",
        "dataclasses.field",
        "msgspec.field",
    ):
        kws = {k.arg: k.value for k in node.keywords if k.arg}
        if "default" in kws:
            return default_repr(src, kws["default"])
        if "default_factory" in kws:
            return {"factory": src.seg(kws["default_factory"], 120)}
        return {"expr": src.seg(node, 120)}
    v = const_eval(node)
    if v is not _NO_VALUE:
        return {"value": v}
    return {"expr": src.seg(node, 160)}


def dotted(node: ast.AST | None) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = dotted(node.value)
        return f"{base}.{node.attr}" if base else None
    return None


def strings_in(node: ast.AST | None) -> str:
    """All string constants inside an expression (help texts, f-strings)."""
    if node is None:
        return ""
    parts = []
    for n in ast.walk(node):
        if isinstance(n, ast.Constant) and isinstance(n.value, str):
            parts.append(n.value)
    return " ".join(parts)


def mentions_deprecated(text: str) -> bool:
    return bool(re.search(r"deprecat", text, re.IGNORECASE))


def says_deprecated(text: str, own_names: Iterable[str] = ()) -> bool:
    """Help text declares *this* option deprecated (not merely mentions another).

    Matches "Deprecated. ...", "(Deprecated, use ...)", "[Deprecated] ...",
    "Deprecated alias for ...", "Note: --own-flag is deprecated ...".
    "Replaces the deprecated --grpc-mode." does not count.
    """
    t = text.strip()
    if re.match(r"^[\(\[]?\s*deprecated\b", t, re.IGNORECASE):
        return True
    if re.search(r"\bdeprecated alias\b", t, re.IGNORECASE):
        return True
    for n in own_names:
        if re.search(re.escape(n) + r"'?\s+is\s+deprecated", t, re.IGNORECASE):
            return True
    return False


def find_class(tree: ast.AST, name: str) -> ast.ClassDef | None:
    for n in ast.walk(tree):
        if isinstance(n, ast.ClassDef) and n.name == name:
            return n
    return None


def find_functions(tree: ast.AST, name: str) -> list[ast.AST]:
    return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name]


def module_imports(src: Src) -> dict[str, tuple[str, str]]:
    """local name -> (module, original name) for `from X import Y as Z`."""
    out = {}
    for n in ast.walk(src.tree):
        if isinstance(n, ast.ImportFrom) and n.module and n.level == 0:
            for a in n.names:
                out[a.asname or a.name] = (n.module, a.name)
    return out


def is_classvar(ann: ast.AST) -> bool:
    d = dotted(ann.value) if isinstance(ann, ast.Subscript) else dotted(ann)
    return d in ("ClassVar", "typing.ClassVar")


def class_field_nodes(cls: ast.ClassDef) -> list[ast.AnnAssign]:
    return [
        s
        for s in cls.body
        if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name) and not is_classvar(s.annotation)
    ]


# --------------------------------------------------------------------------
# server_args
# --------------------------------------------------------------------------


def split_annotated(src: Src, ann: ast.AST) -> tuple[ast.AST, list[ast.AST]]:
    """A[T, meta...] / Annotated[T, meta...] -> (T, [meta...])."""
    if isinstance(ann, ast.Subscript) and dotted(ann.value) in (
        "A",
        "Annotated",
        "typing.Annotated",
    ):
        sl = ann.slice
        if isinstance(sl, ast.Tuple) and sl.elts:
            return sl.elts[0], list(sl.elts[1:])
    return ann, []


def unwrap_optional(node: ast.AST) -> tuple[ast.AST, bool]:
    if isinstance(node, ast.Subscript) and dotted(node.value) in ("Optional", "typing.Optional"):
        return node.slice, True
    if isinstance(node, ast.Subscript) and dotted(node.value) in ("Union", "typing.Union"):
        elts = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        non_none = [e for e in elts if not (isinstance(e, ast.Constant) and e.value is None)]
        if len(non_none) == 1 and len(elts) == 2:
            return non_none[0], True
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        left, right = node.left, node.right
        if isinstance(right, ast.Constant) and right.value is None:
            return left, True
        if isinstance(left, ast.Constant) and left.value is None:
            return right, True
    return node, False


def action_nargs_defaults(wheel: Wheel) -> dict[str, Any]:
    """Custom argparse Action classes -> default nargs of their __init__."""
    out: dict[str, Any] = {}
    for rel in ("sglang/srt/arg_groups/argparse_actions.py",):
        src = wheel.src(rel)
        if src is None:
            continue
        for cls in [n for n in src.tree.body if isinstance(n, ast.ClassDef)]:
            inits = [f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name == "__init__"]
            nargs: Any = None
            if inits:
                args = inits[0].args
                pos = args.args
                defaults = [None] * (len(pos) - len(args.defaults)) + list(args.defaults)
                for a, d in zip(pos, defaults):
                    if a.arg == "nargs" and d is not None:
                        v = const_eval(d)
                        nargs = None if v is _NO_VALUE else v
            out[cls.name] = nargs
    return out


FLAG_ACTIONS = {
    "store_true",
    "store_false",
    "store_const",
    "count",
    "help",
    "version",
    "argparse.BooleanOptionalAction",
    "BooleanOptionalAction",
}


def classify_action(action: str | None, nargs_kw: Any, custom: dict[str, Any]) -> bool:
    """True when the option takes no value on the command line."""
    if action is None:
        return False
    if action in FLAG_ACTIONS:
        return True
    short = action.split(".")[-1]
    if short in custom:
        nargs = custom[short] if nargs_kw is _NO_VALUE else nargs_kw
        return nargs == 0
    return False


def with_negations(option_strings: list[str], action: str | None) -> list[str]:
    if action and action.split(".")[-1] == "BooleanOptionalAction":
        extra = ["--no-" + o[2:] for o in option_strings if o.startswith("--")]
        return option_strings + extra
    return option_strings


def collect_server_arg_fields(wheel: Wheel) -> tuple[list[tuple[Src, ast.ClassDef, ast.AnnAssign]], dict[str, Any]]:
    """Return (src, class, AnnAssign) for every ServerArgs input field."""
    sa = wheel.src("sglang/srt/server_args.py")
    assert sa is not None, "server_args.py missing"
    meta: dict[str, Any] = {"layout": None, "namespaces": []}
    result = []
    cls = find_class(sa.tree, "ServerArgs")
    assert cls is not None, "class ServerArgs missing"
    # Namespaced layout (>=0.5.2x): `_INPUT_NAMESPACES = [Model, ...]` merged
    # into ServerArgs via msgspec.defstruct.
    ns_list = None
    for n in sa.tree.body:
        if (
            isinstance(n, ast.Assign)
            and len(n.targets) == 1
            and isinstance(n.targets[0], ast.Name)
            and n.targets[0].id == "_INPUT_NAMESPACES"
            and isinstance(n.value, (ast.List, ast.Tuple))
        ):
            ns_list = [dotted(e) for e in n.value.elts]
            meta["namespaces_source"] = sa.loc(n)
    if ns_list:
        meta["layout"] = "namespaced msgspec structs (arg_groups/fields/*) merged by msgspec.defstruct"
        imports = module_imports(sa)
        for name in ns_list:
            mod, orig = imports[name]
            rel = wheel.module_path(mod)
            nsrc = wheel.src(rel)
            ncls = find_class(nsrc.tree, orig)
            ns_path = None
            for s in ncls.body:
                if isinstance(s, ast.Assign) and isinstance(s.targets[0], ast.Name) and s.targets[0].id == "_NS_PATH":
                    ns_path = const_eval(s.value)
            meta["namespaces"].append({"class": orig, "ns_path": ns_path, "source": nsrc.loc(ncls)})
            for f in class_field_nodes(ncls):
                result.append((nsrc, ncls, f))
    else:
        meta["layout"] = "single @dataclasses.dataclass ServerArgs in server_args.py"
    for f in class_field_nodes(cls):
        result.append((sa, cls, f))
    return result, meta


def parse_arg_meta(src: Src, metas: list[ast.AST]) -> tuple[dict[str, ast.AST] | None, str]:
    """Return (Arg keyword nodes or None if no CLI metadata, help strings)."""
    for m in metas:
        if isinstance(m, ast.Call) and dotted(m.func) in ("Arg", "arg_utils.Arg"):
            kws = {k.arg: k.value for k in m.keywords if k.arg}
            return kws, strings_in(kws.get("help"))
        if isinstance(m, ast.Call):
            continue  # NS(...), Derived(...) etc.
        # bare help string (Constant / implicit concat / f-string / "a" + "b")
        if isinstance(m, (ast.Constant, ast.JoinedStr, ast.BinOp)) and strings_in(m):
            return {"help": m}, strings_in(m)
    return None, ""


def extract_server_args(wheel: Wheel) -> dict[str, Any]:
    sa = wheel.src("sglang/srt/server_args.py")
    custom_actions = action_nargs_defaults(wheel)
    field_nodes, meta = collect_server_arg_fields(wheel)

    fields: dict[str, Any] = {}
    duplicates = []
    options: dict[str, Any] = {}

    def add_option(entry: dict[str, Any]):
        key = entry["option_strings"][0]
        if key in options:
            # argparse would raise on a conflicting option string
            entry["conflicts_with_earlier_registration"] = options[key]["source"]
            key = f"{key}#{entry['source']}"
        options[key] = entry

    # A name annotated twice in one class body is one field: it keeps the
    # position of its first annotation and the metadata/default of its last
    # (that is how __annotations__ and the class namespace behave), so it is
    # registered with argparse once.
    ordered: dict[str, tuple[Src, ast.ClassDef, ast.AnnAssign]] = {}
    for src, cls, node in field_nodes:
        name = node.target.id
        if name in ordered:
            duplicates.append({"field": name, "first": ordered[name][0].loc(ordered[name][2]), "again": src.loc(node)})
        ordered[name] = (src, cls, node)

    for name, (src, _cls, node) in ordered.items():
        inner_t, metas = split_annotated(src, node.annotation)
        arg_kws, help_text = parse_arg_meta(src, metas)
        finfo: dict[str, Any] = {
            "annotation": src.seg(inner_t, 160),
            "source": src.loc(node),
            "has_default": node.value is not None,
        }
        finfo.update(default_repr(src, node.value))
        cli = arg_kws is not None and const_eval(arg_kws.get("no_cli")) is not True
        finfo["cli"] = cli
        fields[name] = finfo
        if arg_kws is not None:
            if says_deprecated(help_text, ["--" + name.replace("_", "-")]):
                finfo["deprecated"] = True
        if not cli:
            continue

        cli_name = const_eval(arg_kws.get("cli_name"))
        if cli_name is _NO_VALUE or cli_name is None:
            cli_name = "--" + name.replace("_", "-")
        aliases = const_eval(arg_kws.get("aliases"))
        if aliases is _NO_VALUE or aliases is None:
            aliases = []
        names = [cli_name] + list(aliases)
        action = dotted(arg_kws["action"]) if "action" in arg_kws else None
        if action is None and "action" in arg_kws:
            action = src.seg(arg_kws["action"], 80)
        nargs = const_eval(arg_kws.get("nargs"))
        base_t, optional = unwrap_optional(inner_t)
        base_txt = src.seg(base_t, 80) or ""
        if action is not None:
            kind = "action"
            is_flag = classify_action(action, _NO_VALUE, custom_actions)
        elif isinstance(base_t, ast.Subscript) and dotted(base_t.value) in ("Literal", "typing.Literal"):
            kind = "literal"
            is_flag = False
        elif (
            isinstance(base_t, ast.Subscript)
            and dotted(base_t.value) in ("List", "list", "typing.List")
            and "type_parser" not in arg_kws
        ):
            kind = "list"
            is_flag = False
            if nargs is _NO_VALUE or nargs is None:
                nargs = "+"
        elif base_txt == "bool":
            kind = "store_true"
            action = "store_true"
            is_flag = True
        else:
            kind = "scalar"
            is_flag = False
        entry: dict[str, Any] = {
            "option_strings": with_negations(names, action),
            "dest": name,
            "flag": is_flag,
            "origin": "field",
            "source": src.loc(node),
            "deprecated": says_deprecated(help_text, names),
        }
        if mentions_deprecated(help_text) and not entry["deprecated"]:
            entry["help_mentions_deprecated"] = True
        if action is not None:
            entry["action"] = action
        if nargs is not _NO_VALUE and nargs is not None:
            entry["nargs"] = nargs
        choices = arg_kws.get("choices")
        if choices is not None:
            cv = const_eval(choices)
            entry["choices"] = cv if cv is not _NO_VALUE else {"expr": src.seg(choices, 80)}
        elif kind == "literal":
            cv = const_eval(base_t.slice)
            if cv is not _NO_VALUE:
                entry["choices"] = cv if isinstance(cv, list) else [cv]
        entry.update(default_repr(src, node.value) if node.value is not None else {})
        required_kw = const_eval(arg_kws.get("required"))
        if kind == "scalar" and (required_kw is True or (required_kw in (None, _NO_VALUE) and node.value is None)):
            entry["required"] = True
        add_option(entry)

    # Manual registrations inside ServerArgs.add_cli_args.
    cls = find_class(sa.tree, "ServerArgs")
    add_cli = [f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name == "add_cli_args"]
    manual_count = 0
    uses_dataclass_helper = False
    if add_cli:
        for call in ast.walk(add_cli[0]):
            if not isinstance(call, ast.Call):
                continue
            fn = dotted(call.func) or ""
            if fn.endswith("add_cli_args_from_dataclass"):
                uses_dataclass_helper = True
            if not fn.endswith(".add_argument"):
                continue
            manual_count += 1
            names = [const_eval(a) for a in call.args]
            names = [n for n in names if isinstance(n, str)]
            kws = {k.arg: k.value for k in call.keywords if k.arg}
            action = None
            if "action" in kws:
                action = const_eval(kws["action"])
                if action is _NO_VALUE:
                    action = dotted(kws["action"]) or src.seg(kws["action"], 80)
            nargs_kw = const_eval(kws["nargs"]) if "nargs" in kws else _NO_VALUE
            dest = const_eval(kws.get("dest"))
            if dest in (_NO_VALUE, None):
                long_names = [n for n in names if n.startswith("--")]
                dest = (long_names or names)[0].lstrip("-").replace("-", "_")
            help_node = kws.get("help")
            help_text = strings_in(help_node)
            hidden = dotted(help_node) == "argparse.SUPPRESS"
            entry = {
                "option_strings": with_negations(names, action if isinstance(action, str) else None),
                "dest": dest,
                "flag": classify_action(action if isinstance(action, str) else None, nargs_kw, custom_actions),
                "action": action,
                "origin": "manual",
                "source": sa.loc(call),
                "deprecated": says_deprecated(help_text, names)
                or (isinstance(action, str) and action.split(".")[-1].startswith("Deprecated")),
            }
            if mentions_deprecated(help_text) and not entry["deprecated"]:
                entry["help_mentions_deprecated"] = True
            if hidden:
                entry["hidden"] = True
            if nargs_kw is not _NO_VALUE and nargs_kw is not None:
                entry["nargs"] = nargs_kw
            if "choices" in kws:
                cv = const_eval(kws["choices"])
                entry["choices"] = cv if cv is not _NO_VALUE else {"expr": sa.seg(kws["choices"], 80)}
            if "default" in kws:
                d = default_repr(sa, kws["default"])
                # `ServerArgs.x` / `_declared_default("x")` -> the field default
                ref = None
                dn = kws["default"]
                if dotted(dn) and dotted(dn).startswith("ServerArgs."):
                    ref = dotted(dn).split(".", 1)[1]
                elif isinstance(dn, ast.Call) and dotted(dn.func) == "_declared_default" and dn.args:
                    ref = const_eval(dn.args[0])
                if isinstance(ref, str) and ref in fields and "value" in fields[ref]:
                    d = {"value": fields[ref]["value"], "expr": sa.seg(dn, 80)}
                entry.update(d)
            if "new_flag" in kws:
                nf = const_eval(kws["new_flag"])
                if nf is not _NO_VALUE:
                    entry["replacement"] = nf
            add_option(entry)

    # argparse adds -h/--help itself (add_help defaults to True).
    parser_calls = []
    for fn in find_functions(sa.tree, "prepare_server_args"):
        for call in ast.walk(fn):
            if isinstance(call, ast.Call) and (dotted(call.func) or "").endswith("ArgumentParser"):
                kws = {k.arg: const_eval(k.value) for k in call.keywords if k.arg}
                kws = {k: (v if v is not _NO_VALUE else None) for k, v in kws.items()}
                parser_calls.append({"source": sa.loc(call), "kwargs": kws})
            if isinstance(call, ast.Call) and (dotted(call.func) or "").endswith(
                (".parse_args", ".parse_known_args", ".parse_intermixed_args")
            ):
                parser_calls.append({"source": sa.loc(call), "parse_method": dotted(call.func).split(".")[-1]})
    ctor = [p for p in parser_calls if "kwargs" in p]
    add_help = True
    allow_abbrev = True
    if ctor:
        allow_abbrev = ctor[0]["kwargs"].get("allow_abbrev", True)
        add_help = ctor[0]["kwargs"].get("add_help", True)
    if add_help:
        options["-h"] = {
            "option_strings": ["-h", "--help"],
            "dest": "help",
            "flag": True,
            "action": "help",
            "origin": "argparse",
            "source": "argparse (add_help=True)",
            "deprecated": False,
        }

    all_strings: dict[str, str] = {}
    for key, e in options.items():
        for s in e["option_strings"]:
            all_strings.setdefault(s, key)

    return {
        "layout": meta["layout"],
        "namespaces": meta["namespaces"],
        "add_cli_args_uses_dataclass_helper": uses_dataclass_helper,
        "manual_add_argument_calls": manual_count,
        "parser": {
            "calls": parser_calls,
            "allow_abbrev": allow_abbrev,
            "allow_abbrev_note": (
                "argparse default (True): any unambiguous prefix of a long option is accepted; "
                "an ambiguous prefix is an error; unknown flags are an error (parse_args)"
                if allow_abbrev
                else "prefix matching disabled"
            ),
        },
        "options": options,
        "option_index": all_strings,
        "fields": fields,
        "duplicate_field_declarations": duplicates,
    }


def resolve_option(arg: str, option_index: dict[str, str], allow_abbrev: bool) -> dict[str, Any]:
    """Replay CPython 3.11 argparse's long-option lookup for `arg`."""
    opt = arg.split("=", 1)[0]
    if arg in option_index or opt in option_index:
        hit = arg if arg in option_index else opt
        return {"result": "exact", "option": hit, "registered_as": option_index[hit]}
    if not allow_abbrev or not opt.startswith("--"):
        return {"result": "unrecognized"}
    matches = sorted(o for o in option_index if o.startswith(opt))
    if len(matches) == 1:
        return {"result": "prefix", "resolves_to": matches[0], "registered_as": option_index[matches[0]]}
    if len(matches) > 1:
        return {"result": "ambiguous", "candidates": matches}
    return {"result": "unrecognized"}


def key_flag_report(sa: dict[str, Any]) -> dict[str, Any]:
    out = {}
    idx = sa["option_index"]
    for flag in KEY_FLAGS:
        r = resolve_option(flag, idx, sa["parser"]["allow_abbrev"])
        info: dict[str, Any] = {"resolution": r, "exists": r["result"] == "exact"}
        if r["result"] == "exact":
            e = sa["options"][r["registered_as"]]
            info.update(
                {
                    "deprecated": e["deprecated"],
                    "flag": e["flag"],
                    "dest": e["dest"],
                    "source": e["source"],
                }
            )
            if "value" in e:
                info["default"] = e["value"]
            if "replacement" in e:
                info["replacement"] = e["replacement"]
        out[flag] = info
    return out


# --------------------------------------------------------------------------
# io_struct
# --------------------------------------------------------------------------


def struct_kind(cls: ast.ClassDef, known: dict[str, str]) -> str | None:
    for d in cls.decorator_list:
        dn = dotted(d.func) if isinstance(d, ast.Call) else dotted(d)
        if dn in ("dataclass", "dataclasses.dataclass"):
            return "dataclass"
    for b in cls.bases:
        bn = dotted(b)
        if bn in ("msgspec.Struct", "Struct"):
            return "msgspec.Struct"
        if bn in known:
            return known[bn]
    return None


def extract_classes_with_fields(src: Src) -> dict[str, Any]:
    known_kind: dict[str, str] = {}
    classes: dict[str, Any] = {}
    for cls in [n for n in src.tree.body if isinstance(n, ast.ClassDef)]:
        kind = struct_kind(cls, known_kind)
        if kind is None:
            continue
        known_kind[cls.name] = kind
        inherited: list[dict[str, Any]] = []
        bases = []
        for b in cls.bases:
            bn = dotted(b) or src.seg(b, 80)
            bases.append(bn)
            if bn in classes:
                inherited.extend(dict(f, inherited_from=f.get("inherited_from", bn)) for f in classes[bn]["fields"])
        own = []
        for node in class_field_nodes(cls):
            f: dict[str, Any] = {
                "name": node.target.id,
                "annotation": src.seg(node.annotation, 200),
                "required": node.value is None,
                "line": node.lineno,
            }
            f.update(default_repr(src, node.value))
            own.append(f)
        own_names = {f["name"] for f in own}
        fields = [f for f in inherited if f["name"] not in own_names] + own
        entry: dict[str, Any] = {
            "kind": kind,
            "bases": bases,
            "source": src.loc(cls),
            "fields": fields,
        }
        kw = {}
        for k in cls.keywords:
            v = const_eval(k.value)
            kw[k.arg] = v if v is not _NO_VALUE else src.seg(k.value, 60)
        for d in cls.decorator_list:
            if isinstance(d, ast.Call):
                for k in d.keywords:
                    v = const_eval(k.value)
                    kw[k.arg] = v if v is not _NO_VALUE else src.seg(k.value, 60)
        if kw:
            entry["class_kwargs"] = kw
        classes[cls.name] = entry
    return classes


def extract_io_structs(wheel: Wheel) -> dict[str, Any]:
    src = wheel.src("sglang/srt/managers/io_struct.py")
    classes = extract_classes_with_fields(src)
    missing = [n for n in REQUEST_STRUCTS if n not in classes]
    http_extra = None
    mu = wheel.src("sglang/srt/utils/msgspec_utils.py")
    if mu is not None:
        for fn in find_functions(mu.tree, "msgspec_struct_pydantic_core_schema"):
            for call in ast.walk(fn):
                if isinstance(call, ast.Call):
                    for k in call.keywords:
                        if k.arg == "extra_behavior":
                            http_extra = {"extra_behavior": const_eval(k.value), "source": mu.loc(call)}
    return {
        "source": src.rel,
        "classes": classes,
        "request_structs_missing": missing,
        "msgspec_http_body_unknown_fields": http_extra,
    }


# --------------------------------------------------------------------------
# routes
# --------------------------------------------------------------------------


def module_string_assigns(src: Src) -> dict[str, ast.AST]:
    out = {}
    for n in src.tree.body:
        if isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name):
            out[n.targets[0].id] = n.value
    return out


def route_path(src: Src, node: ast.AST, assigns: dict[str, ast.AST]) -> dict[str, Any]:
    v = const_eval(node)
    if isinstance(v, str):
        return {"path": v}
    if isinstance(node, ast.Call) and dotted(node.func) in ("os.environ.get", "os.getenv"):
        env = const_eval(node.args[0]) if node.args else None
        default = const_eval(node.args[1]) if len(node.args) > 1 else None
        return {
            "path": default if isinstance(default, str) else None,
            "env_override": env if isinstance(env, str) else None,
        }
    if isinstance(node, ast.Name) and node.id in assigns:
        r = route_path(src, assigns[node.id], {})
        r.setdefault("via", node.id)
        return r
    return {"path": None, "expr": src.seg(node, 80)}


def route_says_deprecated(doc: str, body_strings: str) -> bool:
    """Docstring or the handler's own warning/error text marks the route deprecated."""
    if says_deprecated(doc) or re.search(r"\(\s*deprecated\b", doc, re.IGNORECASE):
        return True
    if re.search(r"endpoint\b[^.]*\bis deprecated|deprecated endpoint", body_strings, re.IGNORECASE):
        return True
    return False


def extract_routes_from(src: Src, owners: dict[str, str]) -> list[dict[str, Any]]:
    """owners: variable name (app/router) -> url prefix."""
    assigns = module_string_assigns(src)
    out = []
    funcs = [n for n in ast.walk(src.tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    for fn in funcs:
        auth = None
        route_decos = []
        for d in fn.decorator_list:
            if not isinstance(d, ast.Call):
                continue
            fname = dotted(d.func) or ""
            if fname.split(".")[-1] == "auth_level" and d.args:
                auth = src.seg(d.args[0], 60)
            if not isinstance(d.func, ast.Attribute) or dotted(d.func.value) not in owners:
                continue
            attr = d.func.attr
            if attr not in HTTP_METHODS | {"api_route", "websocket", "route"}:
                continue
            route_decos.append((d, attr, owners[dotted(d.func.value)]))
        if not route_decos:
            continue
        doc = ast.get_docstring(fn) or ""
        body_strings = " ".join(
            n.value for n in ast.walk(fn) if isinstance(n, ast.Constant) and isinstance(n.value, str)
        )
        calls_handler = None
        for n in ast.walk(fn):
            if isinstance(n, ast.Return) and isinstance(n.value, ast.Await):
                c = n.value.value
                if isinstance(c, ast.Call) and isinstance(c.func, ast.Name):
                    calls_handler = c.func.id
        params = []
        pos = fn.args.args
        pos_defaults = [None] * (len(pos) - len(fn.args.defaults)) + list(fn.args.defaults)
        for a, d in list(zip(pos, pos_defaults)) + list(zip(fn.args.kwonlyargs, fn.args.kw_defaults)):
            ann = src.seg(a.annotation, 100) if a.annotation else None
            if ann in ("Request", "fastapi.Request", "Response", "WebSocket"):
                continue
            prm = {"name": a.arg, "annotation": ann}
            if d is not None:
                prm["default"] = src.seg(d, 80)
            params.append(prm)
        # A handler whose body is just `raise HTTPException(status_code=N)`.
        stmts = [st for st in fn.body if not (isinstance(st, ast.Expr) and isinstance(st.value, ast.Constant))]
        stub_status = None
        if len(stmts) == 1 and isinstance(stmts[0], ast.Raise) and isinstance(stmts[0].exc, ast.Call):
            exc = stmts[0].exc
            if (dotted(exc.func) or "").endswith("HTTPException"):
                for k in exc.keywords:
                    if k.arg == "status_code":
                        v = const_eval(k.value)
                        stub_status = v if v is not _NO_VALUE else src.seg(k.value, 40)
                if stub_status is None and exc.args:
                    v = const_eval(exc.args[0])
                    stub_status = v if v is not _NO_VALUE else src.seg(exc.args[0], 40)
        route_deprecated = route_says_deprecated(doc, body_strings)
        for d, attr, prefix in route_decos:
            p = route_path(src, d.args[0], assigns) if d.args else {"path": None}
            kws = {k.arg: k.value for k in d.keywords if k.arg}
            if "path" in kws and not d.args:
                p = route_path(src, kws["path"], assigns)
            if attr == "api_route" or attr == "route":
                m = const_eval(kws.get("methods"))
                methods = sorted(m) if isinstance(m, list) else ["GET"]
            elif attr == "websocket":
                methods = ["WEBSOCKET"]
            else:
                methods = [attr.upper()]
            path = p.get("path")
            if path is not None and prefix:
                path = prefix + path
            entry = {
                "path": path,
                "methods": methods,
                "handler": fn.name,
                "source": src.loc(d),
                "params": params,
                "deprecated": route_deprecated,
            }
            if stub_status is not None:
                entry["always_raises_http_status"] = stub_status
            if auth:
                entry["auth_level"] = auth
            for k in ("env_override", "via", "expr"):
                if p.get(k):
                    entry[k] = p[k]
            if calls_handler and calls_handler != fn.name:
                entry["delegates_to_handler"] = calls_handler
            # Decorated inside an `if`/function body (conditional registration)?
            entry["conditional"] = fn not in src.tree.body
            out.append(entry)
    return out


def extract_routes(wheel: Wheel) -> dict[str, Any]:
    src = wheel.src("sglang/srt/entrypoints/http_server.py")
    routes = extract_routes_from(src, {"app": ""})
    imports = module_imports(src)
    included = []
    for call in ast.walk(src.tree):
        if isinstance(call, ast.Call) and dotted(call.func) == "app.include_router" and call.args:
            local = dotted(call.args[0])
            kws = {k.arg: const_eval(k.value) for k in call.keywords if k.arg}
            prefix = kws.get("prefix") if isinstance(kws.get("prefix"), str) else ""
            if local in imports:
                mod, orig = imports[local]
                rel = wheel.module_path(mod)
                rsrc = wheel.src(rel) if rel else None
                if rsrc is not None:
                    rprefix = ""
                    for n in rsrc.tree.body:
                        if (
                            isinstance(n, ast.Assign)
                            and isinstance(n.targets[0], ast.Name)
                            and n.targets[0].id == orig
                            and isinstance(n.value, ast.Call)
                        ):
                            for k in n.value.keywords:
                                if k.arg == "prefix" and isinstance(const_eval(k.value), str):
                                    rprefix = const_eval(k.value)
                    rr = extract_routes_from(rsrc, {orig: prefix + rprefix})
                    for r in rr:
                        r["router"] = f"{mod}.{orig}"
                    routes.extend(rr)
                    included.append({"router": f"{mod}.{orig}", "source": src.loc(call)})
    # add_api_route calls
    for call in ast.walk(src.tree):
        if isinstance(call, ast.Call) and (dotted(call.func) or "").endswith(".add_api_route"):
            p = route_path(src, call.args[0], module_string_assigns(src)) if call.args else {}
            kws = {k.arg: k.value for k in call.keywords if k.arg}
            m = const_eval(kws.get("methods"))
            routes.append(
                {
                    "path": p.get("path"),
                    "methods": sorted(m) if isinstance(m, list) else ["GET"],
                    "handler": dotted(call.args[1]) if len(call.args) > 1 else None,
                    "source": src.loc(call),
                    "params": [],
                    "deprecated": False,
                    "conditional": True,
                }
            )
    # Alias resolution: a handler that only `return await other()`s.
    by_handler: dict[str, list[str]] = {}
    for r in routes:
        if r["path"]:
            by_handler.setdefault(r["handler"], []).append(r["path"])
    by_path: dict[str, list[dict[str, Any]]] = {}
    for r in routes:
        tgt = r.get("delegates_to_handler")
        if tgt in by_handler:
            r["alias_of"] = sorted(set(by_handler[tgt]))
        key = r["path"] if r["path"] is not None else f"<dynamic:{r.get('expr') or r.get('via')}>"
        by_path.setdefault(key, []).append({k: v for k, v in r.items() if k != "path"})
    for k in by_path:
        by_path[k].sort(key=lambda e: (e["source"], e["methods"]))
    deprecated = sorted(
        {
            p: sorted({a for e in es for a in e.get("alias_of", [])})
            for p, es in by_path.items()
            if any(e["deprecated"] for e in es)
        }.items()
    )
    return {
        "source": src.rel,
        "included_routers": included,
        "routes": by_path,
        "deprecated_routes": {p: a for p, a in deprecated},
    }


# --------------------------------------------------------------------------
# sampling params, meta_info, rank, routed experts
# --------------------------------------------------------------------------


def extract_sampling_params(wheel: Wheel) -> dict[str, Any]:
    src = wheel.src("sglang/srt/sampling/sampling_params.py")
    cls = find_class(src.tree, "SamplingParams")
    out: dict[str, Any] = {"source": src.loc(cls)}
    kind = struct_kind(cls, {})
    out["kind"] = kind
    out["class_kwargs"] = {
        k.arg: (const_eval(k.value) if const_eval(k.value) is not _NO_VALUE else src.seg(k.value, 60))
        for k in cls.keywords
    }
    inits = [f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name == "__init__"]
    params: dict[str, Any] = {}
    if inits:
        out["constructor"] = "explicit __init__"
        a = inits[0].args
        pos = a.args[1:]
        defaults = [None] * (len(pos) - len(a.defaults)) + list(a.defaults)
        for arg, d in list(zip(pos, defaults)) + list(zip(a.kwonlyargs, a.kw_defaults)):
            p = {"line": arg.lineno, "annotation": src.seg(arg.annotation, 120)}
            p.update(default_repr(src, d) if d is not None else {"required": True})
            params[arg.arg] = p
    else:
        out["constructor"] = (
            "generated from fields (msgspec.Struct kw_only: unknown keyword -> TypeError)"
            if kind == "msgspec.Struct"
            else "generated from fields"
        )
        for node in class_field_nodes(cls):
            p = {"line": node.lineno, "annotation": src.seg(node.annotation, 120)}
            p.update(default_repr(src, node.value) if node.value is not None else {"required": True})
            params[node.target.id] = p
    out["params"] = params
    # module constants referenced by defaults (e.g. TOP_K_ALL)
    consts = {}
    for n in src.tree.body:
        if isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name):
            nm = n.targets[0].id
            if nm.isupper():
                v = const_eval(n.value)
                if v is not _NO_VALUE and not isinstance(v, (list, dict)):
                    consts[nm] = {"value": v, "source": src.loc(n)}
    out["module_constants"] = consts
    out["sampling_seed"] = params.get("sampling_seed")
    out["sampling_seed_batching"] = sampling_seed_batching(wheel)
    # How the tokenizer manager builds it from the request's dict.
    tm = wheel.src("sglang/srt/managers/tokenizer_manager.py")
    for call in ast.walk(tm.tree):
        if (
            isinstance(call, ast.Call)
            and dotted(call.func) == "self.sampling_params_class"
            and any(isinstance(a, ast.Starred) for a in call.args)
            or isinstance(call, ast.Call)
            and dotted(call.func) == "self.sampling_params_class"
            and any(k.arg is None for k in call.keywords)
        ):
            out["constructed_at"] = {"expr": tm.seg(call, 120), "source": tm.loc(call)}
    return out


def sampling_seed_batching(wheel: Wheel) -> dict[str, Any] | None:
    """How per-request seeds enter the batch (sampling/sampling_batch_info.py)."""
    src = wheel.src("sglang/srt/sampling/sampling_batch_info.py")
    if src is None:
        return None
    out: dict[str, Any] = {}
    for n in ast.walk(src.tree):
        if not isinstance(n, ast.Assign) or not any(isinstance(t, ast.Name) for t in n.targets):
            continue
        name = next(t.id for t in n.targets if isinstance(t, ast.Name))
        if name == "enable_deterministic":
            out["gate"] = {"expr": "enable_deterministic = " + src.seg(n.value, 100), "source": src.loc(n)}
        if name == "sampling_seed" and isinstance(n.value, ast.IfExp):
            out["batch_seed"] = {
                "only_if": src.seg(n.value.test, 80),
                "otherwise": src.seg(n.value.orelse, 40),
                "source": src.loc(n),
            }
            for inner in ast.walk(n.value.body):
                if isinstance(inner, ast.IfExp):
                    v = const_eval(inner.orelse)
                    if v is not _NO_VALUE:
                        out["batch_seed"]["seed_when_request_has_none"] = v
    return out or None


def _meta_keys_in(src: Src, root: ast.AST, var_names: Iterable[str]) -> list[dict[str, Any]]:
    """String keys written into dicts named like `meta_info` under `root`."""
    names = set(var_names)
    found = []

    def is_meta(node: ast.AST) -> bool:
        if isinstance(node, ast.Name) and node.id in names:
            return True
        # out["meta_info"][...]
        if isinstance(node, ast.Subscript) and const_eval(node.slice) == "meta_info":
            return True
        return False

    for n in ast.walk(root):
        if isinstance(n, ast.Assign):
            for t in n.targets:
                if isinstance(t, ast.Name) and t.id in names and isinstance(n.value, ast.Dict):
                    for k in n.value.keys:
                        kv = const_eval(k)
                        if isinstance(kv, str):
                            found.append({"key": kv, "how": "dict literal", "source": src.loc(n)})
                if isinstance(t, ast.Subscript) and is_meta(t.value):
                    kv = const_eval(t.slice)
                    if isinstance(kv, str):
                        found.append({"key": kv, "how": "item assignment", "source": src.loc(n)})
                    else:
                        found.append({"key": None, "how": f"dynamic key {src.seg(t.slice, 60)}", "source": src.loc(n)})
        if (
            isinstance(n, ast.Call)
            and isinstance(n.func, ast.Attribute)
            and n.func.attr == "update"
            and is_meta(n.func.value)
        ):
            for a in n.args:
                if isinstance(a, ast.Dict):
                    for k in a.keys:
                        kv = const_eval(k)
                        if isinstance(kv, str):
                            found.append({"key": kv, "how": "update", "source": src.loc(n)})
                else:
                    found.append({"key": None, "how": f"update({src.seg(a, 60)})", "source": src.loc(n)})
            for k in n.keywords:
                if k.arg:
                    found.append({"key": k.arg, "how": "update kw", "source": src.loc(n)})
    for k in found:
        k["function"] = src.enclosing_function_of_line(int(k["source"].rsplit(":", 1)[1]))
    return found


def extract_meta_info(wheel: Wheel) -> dict[str, Any]:
    rel = "sglang/srt/managers/tokenizer_manager.py"
    src = wheel.src(rel)
    found = _meta_keys_in(src, src.tree, ["meta_info"])
    # Every `meta_info = {...}` literal; the primary one is the dict built per
    # output in the batch-output handler (the first with id + finish_reason).
    primary = None
    literals = []
    for n in ast.walk(src.tree):
        if (
            isinstance(n, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "meta_info" for t in n.targets)
            and isinstance(n.value, ast.Dict)
        ):
            keys = [k for k in (const_eval(k) for k in n.value.keys) if isinstance(k, str)]
            lit = {"keys": keys, "source": src.loc(n), "function": src.enclosing_function_of_line(n.lineno)}
            literals.append(lit)
    literals.sort(key=lambda x: int(x["source"].rsplit(":", 1)[1]))
    for lit in literals:
        if "id" in lit["keys"] and "finish_reason" in lit["keys"] and "prompt_tokens" in lit["keys"]:
            primary = lit
            break
    # Follow imported helpers called as f(meta_info, ...).
    imports = module_imports(src)
    helper_keys = []
    seen = set()
    for call in ast.walk(src.tree):
        if (
            isinstance(call, ast.Call)
            and isinstance(call.func, ast.Name)
            and call.args
            and isinstance(call.args[0], ast.Name)
            and call.args[0].id == "meta_info"
            and call.func.id in imports
            and call.func.id not in seen
        ):
            seen.add(call.func.id)
            mod, orig = imports[call.func.id]
            hrel = wheel.module_path(mod)
            hsrc = wheel.src(hrel) if hrel else None
            if hsrc is None:
                continue
            for fn in find_functions(hsrc.tree, orig):
                pname = fn.args.args[0].arg if fn.args.args else "meta_info"
                for k in _meta_keys_in(hsrc, fn, [pname]):
                    k["via"] = f"{mod}.{orig} (called at {src.loc(call)})"
                    helper_keys.append(k)
    # Metrics-only keys from the time-stats objects.
    metrics_keys = []
    for prel in wheel.py_files("sglang/srt/observability/"):
        psrc = wheel.src(prel)
        if "convert_to_output_meta_info" not in psrc.text:
            continue
        for fn in find_functions(psrc.tree, "convert_to_output_meta_info"):
            for n in ast.walk(fn):
                if isinstance(n, ast.Dict):
                    for k in n.keys:
                        kv = const_eval(k)
                        if isinstance(kv, str):
                            metrics_keys.append({"key": kv, "source": psrc.loc(n)})
                if isinstance(n, ast.Assign):
                    for t in n.targets:
                        if isinstance(t, ast.Subscript) and isinstance(const_eval(t.slice), str):
                            metrics_keys.append({"key": const_eval(t.slice), "source": psrc.loc(n)})
    keys: dict[str, dict[str, list[str]]] = {}
    for k in found + helper_keys:
        if k["key"] is not None:
            e = keys.setdefault(k["key"], {"sources": [], "functions": []})
            if k["source"] not in e["sources"]:
                e["sources"].append(k["source"])
            fnm = k.get("function")
            if fnm and fnm not in e["functions"]:
                e["functions"].append(fnm)
    dynamic = sorted({f"{k['how']} @ {k['source']}" for k in found + helper_keys if k["key"] is None})
    mkeys: dict[str, list[str]] = {}
    for k in metrics_keys:
        mkeys.setdefault(k["key"], [])
        if k["source"] not in mkeys[k["key"]]:
            mkeys[k["key"]].append(k["source"])
    return {
        "source": rel,
        "primary_literal": primary,
        "all_literals": literals,
        "keys": {
            k: {"sources": sorted(v["sources"])[:4], "functions": sorted(v["functions"])} for k, v in keys.items()
        },
        "helper_keys": sorted({k["key"] for k in helper_keys if k["key"]}),
        "dynamic_writes": dynamic,
        "metrics_only_keys": {k: sorted(v)[:2] for k, v in mkeys.items()},
    }


def extract_weight_update_rank(wheel: Wheel) -> dict[str, Any]:
    candidates = [
        "sglang/srt/model_executor/model_runner.py",
        *wheel.py_files("sglang/srt/model_executor/model_runner_components/"),
        "sglang/srt/managers/tp_worker.py",
        "sglang/srt/managers/scheduler.py",
        *wheel.py_files("sglang/srt/managers/scheduler_components/"),
    ]
    findings = []
    for rel in candidates:
        src = wheel.src(rel)
        if src is None or "init_weights_update_group" not in src.text:
            continue
        for fn in find_functions(src.tree, "init_weights_update_group"):
            argn = [a.arg for a in fn.args.args]
            if "rank_offset" not in argn:
                continue
            for n in ast.walk(fn):
                if isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "rank" for t in n.targets):
                    findings.append({"expr": "rank = " + src.seg(n.value, 120), "source": src.loc(n)})
    # tp_rank origin inside the model runner
    guards = []
    for rel in (
        "sglang/srt/managers/tokenizer_control_mixin.py",
        "sglang/srt/managers/tokenizer_manager.py",
        "sglang/srt/managers/tokenizer_communicator_mixin.py",
    ):
        src = wheel.src(rel)
        if src is None:
            continue
        for fn in find_functions(src.tree, "init_weights_update_group"):
            for n in ast.walk(fn):
                if isinstance(n, ast.Assert):
                    guards.append({"assert": src.seg(n.test, 160), "source": src.loc(n)})
    # Where the updater's `tp_rank` comes from (the model runner builds it).
    tp_rank_origin = []
    mr = wheel.src("sglang/srt/model_executor/model_runner.py")
    if mr is not None:
        for n in ast.walk(mr.tree):
            if isinstance(n, ast.Call) and (dotted(n.func) or "").endswith("WeightUpdater"):
                for k in n.keywords:
                    if k.arg == "tp_rank":
                        tp_rank_origin.append({"expr": "tp_rank=" + mr.seg(k.value, 80), "source": mr.loc(k.value)})
    return {
        "rank_expressions": findings,
        "updater_tp_rank_origin": tp_rank_origin,
        "tokenizer_side_guards": guards,
    }


def extract_routed_experts(wheel: Wheel) -> dict[str, Any]:
    out: dict[str, Any] = {}
    det = wheel.src("sglang/srt/managers/detokenizer_manager.py")
    enc = []
    if det is not None:
        for n in ast.walk(det.tree):
            if isinstance(n, ast.Call) and (dotted(n.func) or "").endswith("b64encode"):
                enc.append({"expr": det.seg(n, 120), "source": det.loc(n)})
        for n in ast.walk(det.tree):
            if isinstance(n, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "routed_experts" for t in n.targets
            ):
                out["detokenizer_assignment"] = {"expr": det.seg(n, 160), "source": det.loc(n)}
    out["detokenizer_b64encode_calls"] = enc
    tm = wheel.src("sglang/srt/managers/tokenizer_manager.py")
    for n in ast.walk(tm.tree):
        if isinstance(n, ast.Assign):
            for t in n.targets:
                if (
                    isinstance(t, ast.Subscript)
                    and isinstance(t.value, ast.Name)
                    and t.value.id == "meta_info"
                    and const_eval(t.slice) == "routed_experts"
                ):
                    out["meta_info_write"] = {"expr": tm.seg(n, 120), "source": tm.loc(n)}
    base = wheel.src("sglang/srt/state_capturer/base.py")
    if base is not None:
        for cname in ("BaseHostCache", "BaseDeviceCache"):
            cls = find_class(base.tree, cname)
            if cls is None:
                continue
            for n in ast.walk(cls):
                if isinstance(n, ast.Call):
                    kws = {k.arg: k.value for k in n.keywords if k.arg}
                    if "dtype" in kws and n.args:
                        out[f"{cname}_buffer"] = {
                            "shape": base.seg(n.args[0], 80),
                            "dtype": dotted(kws["dtype"]),
                            "source": base.loc(n),
                        }
                        break
        for fn in find_functions(base.tree, "get_topk"):
            for n in ast.walk(fn):
                if isinstance(n, ast.Subscript) and isinstance(n.slice, ast.Slice):
                    out["get_topk_token_slice"] = {"expr": base.seg(n, 120), "source": base.loc(n)}
                    break
    re_src = wheel.src("sglang/srt/state_capturer/routed_experts.py")
    if re_src is not None:
        cls = find_class(re_src.tree, "RoutedExpertsCapturer")
        if cls is not None:
            for n in ast.walk(cls):
                if isinstance(n, ast.Assign) and any(
                    isinstance(t, ast.Name) and t.id in ("topk_size", "num_layers") for t in n.targets
                ):
                    out.setdefault("capturer_dims", []).append({"expr": re_src.seg(n, 120), "source": re_src.loc(n)})
        for fn in find_functions(re_src.tree, "extract_routed_experts_from_meta_info"):
            for n in ast.walk(fn):
                if isinstance(n, ast.Call) and (dotted(n.func) or "").endswith("frombuffer"):
                    kws = {k.arg: k.value for k in n.keywords if k.arg}
                    out["reference_decoder"] = {
                        "function": "sglang.srt.state_capturer.routed_experts.extract_routed_experts_from_meta_info",
                        "dtype": dotted(kws.get("dtype")),
                        "source": re_src.loc(n),
                    }
    return out


def extract_api_contract(wheel: Wheel) -> dict[str, Any] | None:
    """Generated JSON contract types (sglang/api/v1/api_types.py), if present."""
    rel = "sglang/api/v1/api_types.py"
    src = wheel.src(rel)
    if src is None:
        return None
    classes = {}
    for cls in [n for n in src.tree.body if isinstance(n, ast.ClassDef)]:
        doc = ast.get_docstring(cls) or ""
        policy = None
        if "unknown keys rejected" in doc:
            policy = "reject"
        elif "unknown keys ignored" in doc:
            policy = "ignore"
        fields = class_field_nodes(cls)
        if not fields:
            continue
        entry: dict[str, Any] = {"unknown_keys": policy, "source": src.loc(cls)}
        entry["fields"] = {}
        for f in fields:
            d = default_repr(src, f.value) if f.value is not None else {"required": True}
            entry["fields"][f.target.id] = d
        classes[cls.name] = entry
    gate = None
    ac = wheel.src("sglang/srt/entrypoints/api_contract.py")
    hs = wheel.src("sglang/srt/entrypoints/http_server.py")
    if ac is not None and hs is not None:
        for n in ast.walk(hs.tree):
            if isinstance(n, ast.Call) and dotted(n.func) == "generate_contract_error":
                gate = {
                    "applies_to": "/generate (Python HTTP server); violation -> HTTP 400 {'error': msg}",
                    "source": hs.loc(n),
                    "checker": ac.rel,
                }
    # GenerateReqInput fields the generated GenerateRequest does not declare
    # (GenerateRequest ignores unknown keys, so the Python gate lets them pass).
    io = wheel.src("sglang/srt/managers/io_struct.py")
    gri = find_class(io.tree, "GenerateReqInput") if io is not None else None
    not_in_contract = None
    if gri is not None and "GenerateRequest" in classes:
        declared = set(classes["GenerateRequest"]["fields"])
        not_in_contract = sorted(f.target.id for f in class_field_nodes(gri) if f.target.id not in declared)
    return {
        "source": rel,
        "generate_gate": gate,
        "classes": classes,
        "generate_req_input_fields_not_in_contract": not_in_contract,
    }


# --------------------------------------------------------------------------
# assembly
# --------------------------------------------------------------------------


def field_default(io: dict[str, Any], cls: str, field: str) -> dict[str, Any] | None:
    c = io["classes"].get(cls)
    if not c:
        return None
    for f in c["fields"]:
        if f["name"] == field:
            src = f"{c['source'].split(':')[0]}:{f['line']}"
            d = {"source": src, "annotation": f["annotation"]}
            for k in ("value", "expr", "factory"):
                if k in f:
                    d[k] = f[k]
            if f["required"]:
                d["required"] = True
            return d
    return None


def rl_defaults(sa: dict[str, Any], io: dict[str, Any], sp: dict[str, Any], meta: dict[str, Any]) -> dict[str, Any]:
    wv = sa["fields"].get("weight_version")
    out: dict[str, Any] = {
        "server_args.weight_version": ({k: wv[k] for k in ("value", "expr", "source") if k in wv} if wv else None),
        "flush_cache": {},
        "abort_all_requests": {},
        "AbortReq.abort_all": field_default(io, "AbortReq", "abort_all"),
        "sampling_seed": sp.get("sampling_seed"),
        "meta_info_keys": sorted(meta["keys"]),
    }
    for name, c in sorted(io["classes"].items()):
        for f in c["fields"]:
            if f["name"] == "flush_cache" and name.endswith("Input"):
                out["flush_cache"][name] = field_default(io, name, "flush_cache")
            if f["name"] == "abort_all_requests":
                out["abort_all_requests"][name] = field_default(io, name, "abort_all_requests")
    return out


def snapshot_version(version: str, cache_dir: str, offline: bool) -> dict[str, Any]:
    wheel_path = find_or_download_wheel(version, cache_dir, offline)
    wheel = Wheel(wheel_path)
    with open(wheel_path, "rb") as fh:
        sha = hashlib.sha256(fh.read()).hexdigest()
    sa = extract_server_args(wheel)
    io = extract_io_structs(wheel)
    routes = extract_routes(wheel)
    sp = extract_sampling_params(wheel)
    meta = extract_meta_info(wheel)
    declared = None
    for name in sorted(wheel.names):
        if name.endswith(".dist-info/METADATA"):
            for line in wheel.zf.read(name).decode("utf-8").splitlines():
                if line.startswith("Version:"):
                    declared = line.split(":", 1)[1].strip()
                    break
    return {
        "wheel": {
            "filename": os.path.basename(wheel_path),
            "size_bytes": os.path.getsize(wheel_path),
            "sha256": sha,
            "declared_version": declared,
            "rust_http_server_present": any(n.startswith("sglang/srt/rust_extensions/_server") for n in wheel.names),
        },
        "server_args": sa,
        "key_flags": key_flag_report(sa),
        "io_structs": io,
        "routes": routes,
        "sampling_params": sp,
        "meta_info": meta,
        "weight_update_group_rank": extract_weight_update_rank(wheel),
        "routed_experts": extract_routed_experts(wheel),
        "api_contract": extract_api_contract(wheel),
        "rl_defaults": rl_defaults(sa, io, sp, meta),
    }


def _version_key(version: str) -> tuple:
    """Numeric parts compare as numbers: "0.5.9" sorts before "0.5.16"."""
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in re.split(r"[.+-]", version))


def cross_version(snaps: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """For every ordered pair "A->B" of distinct versions (any number of versions):
    the option strings of A that B does not accept verbatim, and A's routes that B lacks."""
    out = {}
    vs = sorted(snaps, key=_version_key)
    for a in vs:
        for b in vs:
            if a == b:
                continue
            ia = snaps[a]["server_args"]["option_index"]
            sb = snaps[b]["server_args"]
            ib = sb["option_index"]
            missing = {}
            for opt in sorted(ia):
                if opt in ib:
                    continue
                missing[opt] = resolve_option(opt, ib, sb["parser"]["allow_abbrev"])
            ra = set(snaps[a]["routes"]["routes"])
            rb = set(snaps[b]["routes"]["routes"])
            out[f"{a}->{b}"] = {
                "options_not_exact_in_target": missing,
                "routes_missing_in_target": sorted(ra - rb),
            }
    return out


# The launcher's option table (miles_core.engines.sglang.client reads it): per version, every
# option string of `sglang serve` with just what the launcher and the embedded server's
# parser need, and the sampling_params keys /generate accepts. Derived from the snapshot, so
# it can be rebuilt without the wheels.
OPTIONS_FILE = os.path.join(os.path.dirname(__file__), "..", "miles_core", "rollout", "sglang_options.json")


def launcher_options(doc: dict[str, Any]) -> dict[str, Any]:
    """{version: {"allow_abbrev", "options": {option string: facts}, "sampling_params": names}}
    from a snapshot document.
    Every alias and `--no-` negation is its own entry; -h/--help is left out (never emitted)."""
    out = {}
    for version, snap in sorted(doc["versions"].items()):
        sa = snap["server_args"]
        options = {}
        for entry in sa["options"].values():
            if entry.get("action") == "help":
                continue
            facts = {"dest": entry["dest"], "takes_value": not entry["flag"], "deprecated": entry["deprecated"]}
            if entry.get("nargs") is not None:
                facts["nargs"] = entry["nargs"]
            if isinstance(entry.get("choices"), list):
                facts["choices"] = entry["choices"]
            if entry.get("replacement"):
                facts["replacement"] = entry["replacement"]
            for option in entry["option_strings"]:
                negation = option.startswith("--no-") and entry.get("action") == "argparse.BooleanOptionalAction"
                options[option] = {**facts, "negation": True} if negation else facts
        # The /generate gate of 0.5.23 rejects other sampling_params keys; older versions
        # build SamplingParams(**params), a TypeError for an unknown one.
        contract = (snap.get("api_contract") or {}).get("classes", {}).get("SamplingParams")
        sampling = contract["fields"] if contract else snap["sampling_params"]["params"]
        out[version] = {"allow_abbrev": sa["parser"]["allow_abbrev"], "options": dict(sorted(options.items())),
                        "sampling_params": sorted(sampling)}
    return {"generator": "tools/snapshot_sglang.py --options-out (from sglang_contract.json)",
            "versions": out}


def write_options(doc: dict[str, Any], path: str) -> int:
    text = json.dumps(launcher_options(doc), indent=1, sort_keys=True, ensure_ascii=False) + "\n"
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(text)
    print(f"wrote {path} ({len(text)} bytes)", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--versions", nargs="+", default=["0.5.16", "0.5.17", "0.5.23"])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "tests", "contract", "sglang_contract.json"))
    ap.add_argument("--cache-dir", default=DEFAULT_CACHE)
    ap.add_argument("--offline", action="store_true", help="only use cached wheels")
    ap.add_argument("--options-out", default=None,
                    help=f"also write the launcher's option table (normally {OPTIONS_FILE})")
    ap.add_argument("--options-only", action="store_true",
                    help="write --options-out from the existing --out snapshot; no wheel is read")
    args = ap.parse_args(argv)
    if args.options_only:
        with open(args.out, encoding="utf-8") as fh:
            return write_options(json.load(fh), args.options_out or OPTIONS_FILE)
    if len(set(args.versions)) != len(args.versions):
        ap.error(f"--versions has duplicates: {args.versions}")
    snaps = {}
    for v in sorted(args.versions, key=_version_key):
        print(f"snapshotting sglang=={v}", file=sys.stderr)
        snaps[v] = snapshot_version(v, args.cache_dir, args.offline)
    doc = {
        "schema_version": SCHEMA_VERSION,
        "generator": "tools/snapshot_sglang.py (static ast parse of the PyPI wheel)",
        "python_argparse_semantics": "CPython 3.11 (wheels are cp311)",
        "versions": snaps,
        "cross_version": cross_version(snaps) if len(snaps) > 1 else {},
    }
    text = json.dumps(doc, indent=1, sort_keys=True, ensure_ascii=False) + "\n"
    with open(args.out, "w", encoding="utf-8") as fh:
        fh.write(text)
    print(f"wrote {args.out} ({len(text)} bytes)", file=sys.stderr)
    if args.options_out:
        write_options(doc, args.options_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
