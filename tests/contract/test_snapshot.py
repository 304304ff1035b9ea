"""Sanity facts about the static SGLang contract snapshot (sglang_contract.json).

Every assertion here was checked by hand against the wheel's source; the
file:line each fact comes from is recorded in the JSON next to it. The
snapshot is regenerated with tools/snapshot_sglang.py (see README.md).
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import hashlib
import io
import json
import os
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
SNAPSHOT = HERE / "sglang_contract.json"
VERSIONS = ["0.5.16", "0.5.17", "0.5.23"]
# The version that runs for real on the lent GPU machine (tests/gpu); the last to pin torch 2.11.0.
GPU_VERSION = "0.5.17"


@pytest.fixture(scope="module")
def snap() -> dict:
    return json.loads(SNAPSHOT.read_text())


@pytest.fixture(scope="module", params=VERSIONS)
def ver(request, snap) -> dict:
    return snap["versions"][request.param]


def _field(ver: dict, cls: str, name: str) -> dict:
    fields = {f["name"]: f for f in ver["io_structs"]["classes"][cls]["fields"]}
    return fields[name]


def test_all_versions_present(snap):
    assert sorted(snap["versions"]) == VERSIONS
    for v in VERSIONS:
        assert snap["versions"][v]["wheel"]["declared_version"] == v
    assert GPU_VERSION in VERSIONS


def test_cross_version_has_every_ordered_pair(snap):
    assert sorted(snap["cross_version"]) == sorted(f"{a}->{b}" for a in VERSIONS for b in VERSIONS if a != b)
    # 0.5.17 only adds options to 0.5.16: every 0.5.16 option string is still accepted verbatim.
    assert snap["cross_version"]["0.5.16->0.5.17"] == {"options_not_exact_in_target": {},
                                                       "routes_missing_in_target": []}


# ---- server args ---------------------------------------------------------


def test_core_options_exist(ver):
    idx = ver["server_args"]["option_index"]
    for opt in ("--model-path", "--model", "--tp-size", "--tensor-parallel-size", "--port", "--host"):
        assert opt in idx, opt
    assert ver["server_args"]["options"]["--model-path"].get("required") is True


def test_parser_allows_prefix_abbreviations(ver):
    # argparse.ArgumentParser(prog="sglang serve") -- allow_abbrev left at True.
    assert ver["server_args"]["parser"]["allow_abbrev"] is True


def test_weight_version_default(ver):
    assert ver["server_args"]["fields"]["weight_version"]["value"] == "default"
    assert ver["rl_defaults"]["server_args.weight_version"]["value"] == "default"
    assert ver["key_flags"]["--weight-version"]["exists"] is True


def test_rl_launcher_flags_exist_in_both(ver):
    for flag in (
        "--disable-cuda-graph",
        "--dist-init-addr",
        "--nnodes",
        "--node-rank",
        "--moe-a2a-backend",
        "--enable-return-routed-experts",
        "--enable-deterministic-inference",
        "--api-key",
        "--weight-version",
    ):
        assert ver["key_flags"][flag]["exists"] is True, flag
    # --disable-cuda-graph is a deprecated spelling in both versions.
    assert ver["key_flags"]["--disable-cuda-graph"]["deprecated"] is True


@pytest.mark.parametrize("version", ["0.5.16", "0.5.17"])
def test_cuda_graph_max_bs(snap, version):
    old = snap["versions"][version]["key_flags"]["--cuda-graph-max-bs"]
    assert old["exists"] is True
    assert old["deprecated"] is True
    assert old["dest"] == "cuda_graph_max_bs_decode"
    new = snap["versions"]["0.5.23"]["key_flags"]["--cuda-graph-max-bs"]
    # Not registered in 0.5.23; with prefix matching it is *ambiguous*
    # (an argparse error), not silently resolved.
    assert new["exists"] is False
    assert new["resolution"]["result"] == "ambiguous"
    assert new["resolution"]["candidates"] == ["--cuda-graph-max-bs-decode", "--cuda-graph-max-bs-prefill"]


def test_enable_dp_attention_deprecated_only_in_new(snap):
    assert snap["versions"]["0.5.16"]["key_flags"]["--enable-dp-attention"]["deprecated"] is False
    assert snap["versions"]["0.5.17"]["key_flags"]["--enable-dp-attention"]["deprecated"] is False
    assert snap["versions"]["0.5.23"]["key_flags"]["--enable-dp-attention"]["deprecated"] is True


def _replay_parser(sa: dict) -> tuple[argparse.ArgumentParser, dict]:
    """An argparse parser with the snapshot's option strings (values optional)."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=sa["parser"]["allow_abbrev"])
    dest_of = {}
    for i, (key, e) in enumerate(sorted(sa["options"].items())):
        dest = f"opt{i}"
        dest_of[dest] = key
        if e["flag"]:
            parser.add_argument(*e["option_strings"], dest=dest, action="store_true", default=None)
        else:
            parser.add_argument(*e["option_strings"], dest=dest, nargs="?", default=None, const="x")
    return parser, dest_of


def _argparse_outcome(parser, dest_of, arg: str) -> dict:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            ns = parser.parse_args([arg])
        except SystemExit:
            msg = err.getvalue()
            if "ambiguous option" in msg:
                return {"result": "ambiguous"}
            if "unrecognized arguments" in msg:
                return {"result": "unrecognized"}
            return {"result": "error", "message": msg}
    hit = [dest_of[d] for d, v in vars(ns).items() if v is not None]
    return {"result": "parsed", "registered_as": hit}


def test_recorded_resolution_matches_real_argparse(snap):
    """The snapshot's prefix-resolution replay agrees with CPython's argparse."""
    probes = {}
    for v in VERSIONS:
        probes[v] = {f: r["resolution"] for f, r in snap["versions"][v]["key_flags"].items()}
    for pair, data in snap["cross_version"].items():
        target = pair.split("->")[1]
        probes[target].update(data["options_not_exact_in_target"])
    for v in VERSIONS:
        parser, dest_of = _replay_parser(snap["versions"][v]["server_args"])
        for arg, rec in probes[v].items():
            got = _argparse_outcome(parser, dest_of, arg)
            if rec["result"] in ("exact", "prefix"):
                assert got == {"result": "parsed", "registered_as": [rec["registered_as"]]}, (v, arg)
            else:
                assert got["result"] == rec["result"], (v, arg, got)


# ---- io_struct -------------------------------------------------------------


def test_generate_req_input_fields(ver):
    cls = ver["io_structs"]["classes"]["GenerateReqInput"]
    assert cls["kind"] == "dataclass"
    names = {f["name"] for f in cls["fields"]}
    assert {"input_ids", "sampling_params", "return_logprob", "rid", "stream"} <= names
    assert {"return_routed_experts", "routed_experts_start_len"} <= names


def test_request_structs_recorded(ver):
    assert ver["io_structs"]["request_structs_missing"] == []


def test_weight_update_defaults(ver):
    for cls in (
        "UpdateWeightFromDiskReqInput",
        "UpdateWeightsFromDistributedReqInput",
        "UpdateWeightsFromTensorReqInput",
    ):
        assert _field(ver, cls, "flush_cache")["value"] is True, cls
        assert _field(ver, cls, "abort_all_requests")["value"] is False, cls
        assert _field(ver, cls, "weight_version")["value"] is None, cls
    # update_weight_version aborts running requests unless told otherwise.
    assert _field(ver, "UpdateWeightVersionReqInput", "abort_all_requests")["value"] is True
    assert _field(ver, "AbortReq", "abort_all")["value"] is False
    assert _field(ver, "InitWeightsUpdateGroupReqInput", "group_name")["value"] == "weight_update_group"
    assert _field(ver, "InitWeightsUpdateGroupReqInput", "backend")["value"] == "nccl"
    assert _field(ver, "PauseGenerationReqInput", "mode")["value"] == "abort"


def test_msgspec_request_bodies_ignore_unknown_fields(ver):
    assert ver["io_structs"]["msgspec_http_body_unknown_fields"]["extra_behavior"] == "ignore"


# ---- routes ----------------------------------------------------------------


def test_routes_present(ver):
    routes = ver["routes"]["routes"]
    for path in (
        "/generate",
        "/health_generate",
        "/update_weights_from_disk",
        "/flush_cache",
        "/update_weights_from_distributed",
        "/update_weights_from_tensor",
        "/init_weights_update_group",
        "/destroy_weights_update_group",
        "/update_weight_version",
        "/pause_generation",
        "/continue_generation",
        "/abort_request",
        "/release_memory_occupation",
        "/resume_memory_occupation",
        "/model_info",
        "/server_info",
        "/health",
    ):
        assert path in routes, path
    assert routes["/generate"][0]["methods"] == ["POST", "PUT"]
    assert routes["/flush_cache"][0]["methods"] == ["GET", "POST"]


def test_deprecated_route_aliases(ver):
    dep = ver["routes"]["deprecated_routes"]
    assert dep["/get_model_info"] == ["/model_info"]
    assert dep["/get_server_info"] == ["/server_info"]


@pytest.mark.parametrize("version", ["0.5.16", "0.5.17"])
def test_weight_version_route(snap, version):
    old = snap["versions"][version]["routes"]["routes"]
    # Registered, but the handler only raises 404 ("use /model_info").
    assert old["/weight_version"][0]["always_raises_http_status"] == 404
    assert old["/get_weight_version"][0]["always_raises_http_status"] == 404
    new = snap["versions"]["0.5.23"]["routes"]["routes"]
    assert "/weight_version" not in new and "/get_weight_version" not in new


def _route(ver: dict, path: str) -> dict:
    [route] = ver["routes"]["routes"][path]
    assert not route["deprecated"] and not route.get("always_raises_http_status"), path
    return route


def _body(route: dict) -> str:
    [param] = [p for p in route["params"] if p["annotation"].endswith(", Body()]")]
    return param["annotation"].removeprefix("Annotated[").removesuffix(", Body()]")


def _own_fields(ver: dict, cls: str) -> dict:
    """The struct's own fields (BaseReq's rid / http_worker_ipc left out)."""
    return {f["name"]: f for f in ver["io_structs"]["classes"][cls]["fields"] if "inherited_from" not in f}


def _literal_values(annotation: str) -> list[str]:
    """'Literal["abort", "retract"]' -> ["abort", "retract"]."""
    assert annotation.startswith("Literal[") and annotation.endswith("]"), annotation
    return json.loads("[" + annotation.removeprefix("Literal[").removesuffix("]") + "]")


@pytest.mark.parametrize(("path", "cls"), [("/release_memory_occupation", "ReleaseMemoryOccupationReqInput"),
                                           ("/resume_memory_occupation", "ResumeMemoryOccupationReqInput")])
def test_memory_occupation_routes(ver, path, cls):
    """The client POSTs {"tags": [...]} (weights / kv_cache) to release and resume memory."""
    route = _route(ver, path)
    assert route["methods"] == ["GET", "POST"]
    assert _body(route) == cls
    assert ver["io_structs"]["classes"][cls]["kind"] == "msgspec.Struct"
    tags = _own_fields(ver, cls)
    assert list(tags) == ["tags"]
    assert tags["tags"]["annotation"] == "Optional[List[str]]"
    assert tags["tags"]["value"] is None and tags["tags"]["required"] is False


def test_pause_generation_modes(ver):
    route = _route(ver, "/pause_generation")
    assert route["methods"] == ["POST"]
    assert _body(route) == "PauseGenerationReqInput"
    fields = _own_fields(ver, "PauseGenerationReqInput")
    assert list(fields) == ["mode"]
    assert _literal_values(fields["mode"]["annotation"]) == ["abort", "retract", "in_place"]
    assert fields["mode"]["value"] == "abort"
    resume = _route(ver, "/continue_generation")
    assert resume["methods"] == ["POST"] and _body(resume) == "ContinueGenerationReqInput"
    # Every field has a default, so the client's empty body {} is a valid request.
    assert all(not f["required"] for f in ver["io_structs"]["classes"]["ContinueGenerationReqInput"]["fields"])


@pytest.mark.parametrize("version", VERSIONS)
def test_weight_update_sessions_only_in_newest(snap, version):
    """/begin_weight_update and /end_weight_update are new in 0.5.23; a real 0.5.17 server
    answered 404 to /begin_weight_update, which the client reads as "no sessions here"."""
    ver = snap["versions"][version]
    routes = ver["routes"]["routes"]
    if version == "0.5.23":
        begin = _route(ver, "/begin_weight_update")
        assert begin["methods"] == ["POST"] and _body(begin) == "BeginWeightUpdateReqInput"
        selector = _own_fields(ver, "BeginWeightUpdateReqInput")["selector"]
        assert _literal_values(selector["annotation"]) == ["target", "draft", "all"]
        assert selector["value"] == "all"
        end = _route(ver, "/end_weight_update")
        assert end["methods"] == ["POST"] and _body(end) == "EndWeightUpdateReqInput"
        assert _own_fields(ver, "EndWeightUpdateReqInput") == {}
    else:
        assert "/begin_weight_update" not in routes and "/end_weight_update" not in routes
        missing = snap["cross_version"][f"0.5.23->{version}"]["routes_missing_in_target"]
        assert {"/begin_weight_update", "/end_weight_update"} <= set(missing)


@pytest.mark.parametrize("flag", ["--enable-memory-saver", "--enable-deterministic-inference"])
def test_rl_flags_are_exact_current_flags(ver, flag):
    entry = ver["key_flags"][flag]
    assert entry["exists"] is True
    assert entry["resolution"] == {"option": flag, "registered_as": flag, "result": "exact"}
    assert entry["flag"] is True and entry["deprecated"] is False and entry["default"] is False
    assert entry["dest"] == flag.removeprefix("--").replace("-", "_")


# ---- sampling params / meta_info / rank / routed experts ---------------------


def test_sampling_seed(ver):
    sp = ver["sampling_params"]
    assert sp["params"]["sampling_seed"]["value"] is None
    assert sp["params"]["sampling_seed"]["annotation"] == "Optional[int]"
    assert sp["kind"] == "msgspec.Struct"
    # The seed only reaches the sampler with --enable-deterministic-inference;
    # then a request without one gets 42.
    batch = sp["sampling_seed_batching"]["batch_seed"]
    assert batch["only_if"] == "enable_deterministic"
    assert batch["otherwise"] == "None"
    assert batch["seed_when_request_has_none"] == 42
    assert "enable_deterministic_inference" in sp["sampling_seed_batching"]["gate"]["expr"]
    # 0.5.23 checks /generate bodies against its generated contract first: the seed is declared there.
    contract = (ver["api_contract"] or {}).get("classes", {}).get("SamplingParams")
    if contract is not None:
        assert contract["fields"]["sampling_seed"] == {"value": None}


def test_meta_info_keys(ver):
    primary = ver["meta_info"]["primary_literal"]["keys"]
    assert {"id", "finish_reason", "prompt_tokens", "weight_version"} <= set(primary)
    keys = set(ver["meta_info"]["keys"])
    assert {
        "completion_tokens",
        "cached_tokens",
        "output_token_logprobs",
        "input_token_logprobs",
        "routed_experts",
        "e2e_latency",
    } <= keys


def test_weight_versions_span_key_is_new(snap):
    assert "weight_versions" not in snap["versions"]["0.5.16"]["meta_info"]["keys"]
    assert "weight_versions" not in snap["versions"]["0.5.17"]["meta_info"]["keys"]
    assert "weight_versions" in snap["versions"]["0.5.23"]["meta_info"]["keys"]


def test_weight_update_group_rank(ver):
    exprs = [e["expr"] for e in ver["weight_update_group_rank"]["rank_expressions"]]
    assert exprs == ["rank = rank_offset + self.tp_rank"]


def test_routed_experts_encoding(ver):
    re_ = ver["routed_experts"]
    assert re_["BaseHostCache_buffer"]["dtype"] == "torch.int32"
    assert re_["BaseHostCache_buffer"]["shape"] == "(num_tokens, num_layers, topk_size)"
    assert re_["reference_decoder"]["dtype"] == "np.int32"
    assert any("b64encode" in c["expr"] for c in re_["detokenizer_b64encode_calls"])


# ---- regeneration (only when the cached wheels are on this machine) ---------


def _cached_wheels_match(snap) -> bool:
    for v in VERSIONS:
        w = snap["versions"][v]["wheel"]
        path = os.path.join("/tmp/sglang-wheels", w["filename"])
        if not os.path.exists(path):
            return False
        with open(path, "rb") as fh:
            if hashlib.sha256(fh.read()).hexdigest() != w["sha256"]:
                return False
    return True


def test_snapshot_is_reproducible(snap, tmp_path):
    if not glob.glob("/tmp/sglang-wheels/sglang-*.whl") or not _cached_wheels_match(snap):
        pytest.skip("cached SGLang wheels not present in /tmp/sglang-wheels")
    from tools import snapshot_sglang

    out = tmp_path / "regen.json"
    snapshot_sglang.main(["--versions", *VERSIONS, "--out", str(out), "--offline"])
    assert out.read_text() == SNAPSHOT.read_text()
