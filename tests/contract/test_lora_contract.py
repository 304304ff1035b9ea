"""The SGLang facts the LoRA path relies on, per version, from sglang_contract.json (parsed from the
0.5.16, 0.5.17 and 0.5.23 wheels): the routes and request structs the client sends and the embedded
server mirrors, `lora_path` on /generate, and the server args the launcher emits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from miles_core.engines.embedded.http_requests import GenerateReqInput, LoadLoRAAdapterReqInput, UnloadLoRAAdapterReqInput
from miles_core.engines.sglang.args import LIST_ARGS, SERVER_ARGS, SGLANG_ALL_MODULES, lora_server_args

SNAPSHOT = json.loads((Path(__file__).parent / "sglang_contract.json").read_text())
VERSIONS = sorted(SNAPSHOT["versions"])
ROUTES = {"/load_lora_adapter": "LoadLoRAAdapterReqInput", "/unload_lora_adapter": "UnloadLoRAAdapterReqInput",
          "/load_lora_adapter_from_tensors": "LoadLoRAAdapterFromTensorsReqInput"}


def _fields(version: str, cls: str) -> dict[str, dict]:
    return {f["name"]: f for f in SNAPSHOT["versions"][version]["io_structs"]["classes"][cls]["fields"]}


@pytest.mark.parametrize("version", VERSIONS)
def test_lora_routes_take_the_structs_the_client_sends(version):
    routes = SNAPSHOT["versions"][version]["routes"]["routes"]
    for path, cls in ROUTES.items():
        [route] = routes[path]
        assert route["methods"] == ["POST"] and not route["deprecated"], (version, path)
        assert route["params"][0]["annotation"] == f"Annotated[{cls}, Body()]", (version, path)
    # what the client sends (names by which generation refers to the adapter), required, as str
    load, unload = _fields(version, "LoadLoRAAdapterReqInput"), _fields(version, "UnloadLoRAAdapterReqInput")
    for fields, names in ((load, ("lora_name", "lora_path")), (unload, ("lora_name",))):
        for name in names:
            assert fields[name]["annotation"] == "str" and fields[name]["required"], (version, name)
    assert load["pinned"]["value"] is False  # unpinned by default: SGLang may evict it (the stand-in never does)
    # the embedded server's structs have exactly SGLang's own fields (besides BaseReq's rid/http_worker_ipc)
    for ours, theirs in ((LoadLoRAAdapterReqInput, load), (UnloadLoRAAdapterReqInput, unload)):
        assert set(ours.model_fields) == {n for n, f in theirs.items() if f.get("inherited_from") != "BaseReq"}


@pytest.mark.parametrize("version", VERSIONS)
def test_lora_update_output_answers_success_and_error_message(version):
    fields = _fields(version, "LoRAUpdateOutput")
    assert fields["success"]["annotation"] == "bool" and fields["success"]["required"]
    assert fields["error_message"]["annotation"] == "Optional[str]"
    assert fields["loaded_adapters"]["annotation"] == "Optional[Dict[str, Union[str, LoRARef]]]"


@pytest.mark.parametrize("version", VERSIONS)
def test_generate_names_an_adapter_in_lora_path(version):
    field = _fields(version, "GenerateReqInput")["lora_path"]
    assert field["annotation"] == "Optional[Union[List[Optional[str]], str]]" and field["value"] is None
    assert "lora_path" in GenerateReqInput.model_fields
    contract = SNAPSHOT["versions"][version]["api_contract"]
    if contract is not None:  # 0.5.23 checks /generate bodies against a schema: lora_path is in it
        assert "lora_path" in contract["classes"]["GenerateRequest"]["fields"]


@pytest.mark.parametrize("version", VERSIONS)
def test_lora_server_args_are_what_the_launcher_emits(version):
    args = SNAPSHOT["versions"][version]["server_args"]
    options = args["options"]
    assert options["--enable-lora"]["action"] == "store_true" and options["--enable-lora"]["value"] is None
    for name in ("max_lora_rank", "max_loaded_loras"):
        assert args["fields"][name]["annotation"] == "Optional[int]" and args["fields"][name]["value"] is None
    assert args["fields"]["max_loras_per_batch"]["value"] == 8  # what sglang_args assumes when unset
    modules = options["--lora-target-modules"]
    assert modules["nargs"] == "*" and modules["choices"]["expr"] == "SUPPORTED_LORA_TARGET_MODULES + [LORA_TARGET_ALL_MODULES]"
    assert options["--lora-paths"]["action"] == "LoRAPathAction"
    for name in ("enable_lora", "max_lora_rank", "lora_target_modules", "max_loras_per_batch", "max_loaded_loras",
                 "lora_paths"):
        assert name in SERVER_ARGS
    assert LIST_ARGS == {"lora_target_modules", "lora_paths"}


def test_all_linear_is_spelled_out_for_sglang():
    """SGLang's "all" (LORA_TARGET_ALL_MODULES) also builds adapter buffers for lm_head and
    embed_tokens: training.lora's all-linear is its seven projections, each a supported module."""
    args = lora_server_args({}, 8, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    assert SGLANG_ALL_MODULES not in args["lora_target_modules"] and len(args["lora_target_modules"]) == 7
