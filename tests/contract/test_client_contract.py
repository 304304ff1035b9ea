"""Our launcher, client and embedded server checked against SGLang's own source (the snapshot in
sglang_contract.json, taken from the 0.5.16, 0.5.17 and 0.5.23 wheels): every flag we can emit is an
exact option, every payload key a real field of the route's request struct, defaults SGLang
chooses differently from us are sent explicitly, and the stand-in serves SGLang's routes."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from miles_core.config.rollout import RolloutConfig
from miles_core.engines.sglang.args import SERVER_ARGS, SGLANG_VERSIONS_CHECKED, server_arg_flags
from miles_core.engines.sglang.client import WEIGHT_UPDATE_DEFAULTS, SGLangClient
from miles_core.rollout.manager import RolloutManager

SNAPSHOT = json.loads((Path(__file__).parent / "sglang_contract.json").read_text())
VERSIONS = sorted(SNAPSHOT["versions"])
# Routes of the embedded server that SGLang does not have, each for a reason.
EMBEDDED_EXTRAS = {"/get_weights_checksum": "tests compare engine and trainer weights over HTTP"}
# Routes of the newest version only: the stand-in is as strict as it, and the client probes for them.
NEWEST_ONLY = {"/begin_weight_update", "/end_weight_update"}


def test_the_versions_checked_are_the_snapshots():
    assert tuple(VERSIONS) == SGLANG_VERSIONS_CHECKED


@pytest.mark.parametrize("version", VERSIONS)
def test_every_server_arg_is_an_exact_current_option(version):
    """No argparse prefix match, no deprecated spelling, flags where SGLang has flags."""
    server_args = SNAPSHOT["versions"][version]["server_args"]
    for name, is_flag in SERVER_ARGS.items():
        option = "--" + name.replace("_", "-")
        assert option in server_args["option_index"], (version, option)
        entry = server_args["options"][server_args["option_index"][option]]
        assert not entry["deprecated"], (version, option)
        assert entry["flag"] == is_flag, (version, option)


def _recorded_calls(monkeypatch, version: str) -> list[tuple[str, str, dict]]:
    """Every (method, path, payload) the client sends, answered with a success, or with 404 for
    a route this SGLang version does not have (as its server answers)."""
    calls = []
    routes = SNAPSHOT["versions"][version]["routes"]["routes"]

    class Answer:
        content, url, text = b"{}", "fake", "{}"

        def __init__(self, body: dict, status_code: int = 200):
            self.body, self.status_code = body, status_code

        def json(self) -> dict:
            return self.body

    def call(self, method, path, payload=None, ok_statuses=(), **_):
        calls.append((method, path, payload or {}))
        if path not in routes:
            assert 404 in ok_statuses, (version, path)  # only a call that expects a 404 may meet one
            return Answer({"detail": "Not Found"}, 404)
        if path == "/generate":
            return Answer({"text": "", "output_ids": [], "meta_info": {"input_token_logprobs": []}})
        return Answer({"success": True, "message": "ok"})

    monkeypatch.setattr(SGLangClient, "_call", call)
    return calls


def _rollout_params(seeds: list[int]) -> list[dict]:
    """The per-sample sampling params the rollout manager sends."""
    manager = RolloutManager.__new__(RolloutManager)  # sampling_params reads only the rollout section
    manager.rollout = RolloutConfig(temperature=1.0, top_p=0.9, max_new_tokens=4)
    return manager.sampling_params(seeds)


def _drive_client(client: SGLangClient) -> None:
    """Every call the client has, as the rollout, weight transports and engine group make them."""
    client.generate([[1, 2]], _rollout_params([7]), return_logprob=True, rid=["r"],
                    return_routed_experts=True)
    client.score_prompt([1, 2, 3])
    client.update_weights_from_disk("/m", weight_version="1", load_format="safetensors")
    client.init_weights_update_group("127.0.0.1", 1234, 1, 3, "g", "nccl")
    with client.weight_update_session():
        client.update_weights_from_distributed(["w"], ["bfloat16"], [[2]], "g", weight_version="2")
    client.destroy_weights_update_group("g")
    client.update_weight_version("3")
    client.load_lora_adapter("policy-v3", "/run/weight_sync/lora-v000003")
    client.generate([[1, 2]], _rollout_params([8]), return_logprob=True, lora_path="policy-v3")
    client.unload_lora_adapter("policy-v2")
    client.pause("abort")
    client.resume()
    client.abort()
    client.abort("r")
    client.release_memory(["kv_cache"])
    client.resume_memory(["kv_cache"])
    client.model_info()
    client.server_info()


def _body_class(route: dict) -> str | None:
    for param in route.get("params", []):
        if m := re.match(r"Annotated\[(\w+), Body\(\)\]", param.get("annotation", "")):
            return m.group(1)
        if param.get("annotation", "").endswith("ReqInput") or param.get("annotation") == "AbortReq":
            return param["annotation"]
    return None


@pytest.mark.parametrize("version", VERSIONS)
def test_every_call_is_a_current_route_with_real_fields(version, monkeypatch):
    calls = _recorded_calls(monkeypatch, version)
    _drive_client(SGLangClient("http://sglang"))
    snap = SNAPSHOT["versions"][version]
    routes, classes = snap["routes"]["routes"], snap["io_structs"]["classes"]
    deprecated = set(snap["routes"]["deprecated_routes"])
    sampling_fields = set(snap["sampling_params"]["params"])
    for method, path, payload in calls:
        if path == "/begin_weight_update" and path not in routes:
            continue  # the session probe; answered 404 where sessions do not exist
        assert path in routes and path not in deprecated, (version, path)
        route = next(r for r in routes[path] if method in r["methods"])
        assert not route.get("always_raises_http_status"), (version, path)
        cls = _body_class(route)
        if payload:
            assert cls is not None, (version, path, route)
            fields = {f["name"] for f in classes[cls]["fields"]}
            assert set(payload) <= fields, (version, path, set(payload) - fields)
        for params in ([payload["sampling_params"]] if isinstance(payload.get("sampling_params"), dict)
                       else payload.get("sampling_params", [])):
            assert set(params) <= sampling_fields, (version, set(params) - sampling_fields)


@pytest.mark.parametrize("version", VERSIONS)
def test_defaults_sglang_chooses_otherwise_are_sent(version, monkeypatch):
    """Every weight update flushes the prefix cache and lets running requests finish, whatever
    the server's default; the values we send are the ones the request structs define."""
    calls = _recorded_calls(monkeypatch, version)
    _drive_client(SGLangClient("http://sglang"))
    classes = SNAPSHOT["versions"][version]["io_structs"]["classes"]
    updates = {path: payload for _, path, payload in calls if path.startswith("/update_weights_from")}
    assert set(updates) == {"/update_weights_from_disk", "/update_weights_from_distributed"}
    for payload in updates.values():
        assert {k: payload[k] for k in WEIGHT_UPDATE_DEFAULTS} == WEIGHT_UPDATE_DEFAULTS
    for cls in ("UpdateWeightFromDiskReqInput", "UpdateWeightsFromDistributedReqInput"):
        assert {f["name"] for f in classes[cls]["fields"]} >= set(WEIGHT_UPDATE_DEFAULTS)
    # update_weight_version aborts running requests by default: we say it must not
    [version_update] = [p for _, path, p in calls if path == "/update_weight_version"]
    assert version_update["abort_all_requests"] is False


@pytest.mark.parametrize("version", VERSIONS)
def test_a_distributed_update_runs_inside_a_session_where_sglang_has_them(version, monkeypatch):
    """SGLang 0.5.23 refuses update_weights_from_distributed outside begin/end_weight_update;
    0.5.16 and 0.5.17 have neither route, and get only the probe (a real 0.5.17 answers it 404)."""
    calls = _recorded_calls(monkeypatch, version)
    _drive_client(SGLangClient("http://sglang"))
    paths = [path for _, path, _ in calls]
    update = paths.index("/update_weights_from_distributed")
    if "/begin_weight_update" in SNAPSHOT["versions"][version]["routes"]["routes"]:
        assert paths[update - 1] == "/begin_weight_update" and paths[update + 1] == "/end_weight_update"
    else:
        assert paths[update - 1] == "/begin_weight_update" and "/end_weight_update" not in paths


def test_group_samples_get_one_seed_each():
    assert [p["sampling_seed"] for p in _rollout_params([5, 6, 7])] == [5, 6, 7]


def test_sample_seeds_stay_within_int64_for_any_run_seed():
    """SGLang refuses a sampling_seed outside int64 with a 400 for every request of the batch."""
    manager = RolloutManager.__new__(RolloutManager)
    manager.rollout = type("Rollout", (), {"num_samples_per_prompt": 8})()
    huge = 10**9 * 100_003 + 10**6 * 97  # loop.py's step seed for run seed 1e9 at step 1e6
    seeds = [s for position in range(64) for s in manager._seeds(position, huge)]
    assert all(0 <= s < 2**63 for s in seeds) and len(set(seeds)) == len(seeds)
    assert manager._seeds(3, 7) == [7 * 1_000_003 + 3 * 8 + j for j in range(8)]  # small seeds unchanged


@pytest.mark.parametrize("version", VERSIONS)
def test_the_embedded_server_serves_sglang_routes(version):
    from miles_core.engines.embedded.http_server import create_app
    from miles_core.engines.embedded.service import EngineService

    app = create_app(EngineService("unused"))
    sglang_routes = SNAPSHOT["versions"][version]["routes"]["routes"]
    for route in app.routes:
        path = getattr(route, "path", None)
        if path is None or path in EMBEDDED_EXTRAS or (path in NEWEST_ONLY and version != VERSIONS[-1]):
            continue
        assert path in sglang_routes, (version, path)
        live = [r for r in sglang_routes[path] if not r.get("always_raises_http_status")]
        assert live, (version, path)
        assert set(route.methods) <= {m for r in live for m in r["methods"]}, (version, path)


@pytest.mark.parametrize("version", VERSIONS)
def test_the_embedded_server_takes_sglang_pause_modes(version):
    """The stand-in accepts exactly the modes of SGLang's PauseGenerationReqInput."""
    from miles_core.engines.embedded.http_requests import PAUSE_MODES

    [mode] = [f for f in SNAPSHOT["versions"][version]["io_structs"]["classes"]["PauseGenerationReqInput"]["fields"]
              if f["name"] == "mode"]
    assert mode["annotation"] == "Literal[" + ", ".join(json.dumps(m) for m in PAUSE_MODES) + "]", version
    assert mode["value"] == "abort"


def test_launcher_flags_parse_exactly():
    flags = server_arg_flags({"tp_size": 2, "enable_deterministic_inference": True, "weight_version": "0"})
    assert flags == ["--tp-size", "2", "--enable-deterministic-inference", "--weight-version", "0"]
