"""What a request body may be: SGLang's request structs as the embedded server validates them.

Bodies are checked as SGLang's FastAPI server checks them: a malformed, non-object or wrongly
typed body is a 400 in SGLang's ErrorResponse shape, never a 500; its error messages are worded
as FastAPI words them, cut short so that no body is echoed whole.
"""

from __future__ import annotations

import json
import reprlib
from http import HTTPStatus
from typing import Annotated, Any, Literal, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

PAUSE_MODES = ("abort", "retract", "in_place")


# ---- request bodies: SGLang's request structs (managers/io_struct.py) ------------------------------
# Lists stop at their first bad item: pydantic's default reports every one, and a body's worth of
# them costs minutes and gigabytes.
Strs = Annotated[list[str], Field(fail_fast=True)]
IntRows = Annotated[list[Annotated[list[int], Field(fail_fast=True)]], Field(fail_fast=True)]
I64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
I64s = Annotated[list[I64], Field(fail_fast=True)]
I64Rows = Annotated[list[I64s], Field(fail_fast=True)]
Bools = Annotated[list[bool], Field(fail_fast=True)]
Dicts = Annotated[list[dict[str, Any]], Field(fail_fast=True)]


class SGLangStruct(BaseModel):
    """SGLang's msgspec structs reach FastAPI as typed dicts: unknown keys ignored, lax types
    ("5" for an int, never 5 for a string)."""

    model_config = ConfigDict(extra="ignore")


class AbortReq(SGLangStruct):
    rid: str | None = None
    abort_all: bool = False


class PauseGenerationReqInput(SGLangStruct):
    mode: Literal[PAUSE_MODES] = "abort"


class ContinueGenerationReqInput(SGLangStruct):
    torch_empty_cache: bool = True


class MemoryOccupationReqInput(SGLangStruct):  # Release- and ResumeMemoryOccupationReqInput
    tags: Strs | None = None


class UpdateWeightVersionReqInput(SGLangStruct):
    new_version: str
    abort_all_requests: bool = True  # SGLang's default


class UpdateWeightFromDiskReqInput(SGLangStruct):
    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    flush_cache: bool = True


class InitWeightsUpdateGroupReqInput(SGLangStruct):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "gloo"  # SGLang's is nccl; the embedded engine also runs on CPU


class UpdateWeightsFromDistributedReqInput(SGLangStruct):
    names: Strs
    dtypes: Strs
    shapes: IntRows
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None


class DestroyWeightsUpdateGroupReqInput(SGLangStruct):
    group_name: str = "weight_update_group"


class BeginWeightUpdateReqInput(SGLangStruct):
    selector: Literal["target", "draft", "all"] = "all"


class EndWeightUpdateReqInput(SGLangStruct):
    pass


class LoadLoRAAdapterReqInput(SGLangStruct):
    lora_name: str
    lora_path: str
    pinned: bool = False  # SGLang keeps a pinned adapter from eviction; the embedded engine evicts none
    lora_id: str | None = None


class UnloadLoRAAdapterReqInput(SGLangStruct):
    lora_name: str
    lora_id: str | None = None


class GenerateReqInput(BaseModel):
    """The /generate fields the engine reads, as SGLang 0.5.23 admits them: its JSON contract
    (sglang/api/v1/api_types.py) takes JSON types exactly (no "5" for 5) and integers in int64."""

    model_config = ConfigDict(extra="ignore", strict=True)
    rid: str | Strs | None = None
    text: str | Strs | None = None
    input_ids: I64s | I64Rows | None = None
    sampling_params: dict[str, Any] | Dicts | None = None
    return_logprob: bool | Bools | None = None
    logprob_start_len: I64 | I64s | None = None
    return_routed_experts: bool = False
    stream: bool | None = None
    lora_path: str | Annotated[list[str | None], Field(fail_fast=True)] | None = None
    """The loaded LoRA adapter (by name) to generate with, or one per prompt; None: the base."""


# ---- errors ------------------------------------------------------------------------------------

class RequestError(Exception):
    """A request SGLang's validation refuses: answered in its ErrorResponse shape."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.message, self.status = message, status


def _error(status: int, message: str) -> JSONResponse:
    """SGLang's answer to a request its handler refuses (_create_error_response)."""
    return JSONResponse({"error": {"message": message}}, status_code=status)


def _sglang_error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    """SGLang's answer to a body its validation refuses (400, type "Bad Request") or to an
    HTTPException (type: the status), both as the OpenAI protocol's ErrorResponse."""
    kind = HTTPStatus.BAD_REQUEST.phrase if status == 400 else str(status)
    return JSONResponse({"object": "error", "message": message, "type": kind, "param": None, "code": status},
                        status_code=status, headers=headers)


_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxlist, _SHORT.maxdict, _SHORT.maxstring, _SHORT.maxother = 3, 4, 4, 60, 60
MAX_ERRORS_SHOWN = 5


def _validation_message(errors: list[dict]) -> str:
    """Validation errors as SGLang words them (FastAPI's list, each with its input), the first
    few, their inputs cut short: echoed whole, one input could be megabytes."""
    shown = [{"type": e["type"], "loc": ("body", *e["loc"]), "msg": e["msg"], "input": _SHORT.repr(e.get("input")),
              **({"ctx": {k: str(v)[:200] for k, v in e["ctx"].items()}} if e.get("ctx") else {})}
             for e in errors[:MAX_ERRORS_SHOWN]]
    more = f" and {len(errors) - MAX_ERRORS_SHOWN} more" if len(errors) > MAX_ERRORS_SHOWN else ""
    return f"{len(errors)} validation error{'s' if len(errors) > 1 else ''}: {shown}{more}"


# ---- bodies: read, parsed and validated --------------------------------------------------------

M = TypeVar("M", bound=BaseModel)


async def _json(request: Request) -> Any:
    """The request's JSON body, or RequestError worded as FastAPI words each failure."""
    raw = await request.body()
    if not raw.strip():  # SGLang's handlers take a required Body(): an empty one is refused
        raise RequestError(_validation_message([{"type": "missing", "loc": (), "msg": "Field required"}]))
    media = request.headers.get("content-type", "application/json").split(";")[0].strip().lower()
    if media != "application/json" and not (media.startswith("application/") and media.endswith("+json")):
        raise RequestError(f"Unsupported Media Type {media!r}: the body must be application/json")
    try:
        return json.loads(raw)
    except json.JSONDecodeError as exc:
        raise RequestError(_validation_message([{"type": "json_invalid", "loc": (exc.pos,), "msg": "JSON decode error",
                                                 "input": {}, "ctx": {"error": exc.msg}}])) from None
    except (ValueError, RecursionError):  # invalid UTF-8, a 5000-digit number, nesting past the parser's stack
        raise RequestError("There was an error parsing the body") from None


def _validated(model: type[M], data: Any) -> M:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise RequestError(_validation_message(exc.errors(include_url=False))) from None


async def _parse(request: Request, model: type[M]) -> M:
    return _validated(model, await _json(request))
