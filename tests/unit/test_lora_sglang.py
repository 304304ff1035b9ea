"""training.lora with SGLang engines: the launcher args (filled in or checked at config load), and
SGLang's LoRA routes on the embedded server as the client calls them (/load_lora_adapter,
/unload_lora_adapter, lora_path on /generate), with SGLang's refusals."""

import pytest
import requests

from miles_core.config import build_config
from miles_core.config.base import ConfigError
from miles_core.engines.embedded.http_server import parse_args, serve
from miles_core.engines.sglang.args import server_arg_flags
from miles_core.engines.sglang.client import EngineError, SGLangClient
from miles_core.training.fsdp import FSDPTrainer
from tests.support import max_abs_diff, random_samples

SGLANG = ["rollout.engine={kind: sglang, server_module: miles_core.engines.embedded.http_server}", "rollout.gpus_per_engine=0"]
LORA = ["training.lora.rank=4", "training.lora.alpha=8", "training.num_threads=1", "training.lr=1e-2"]
ALL_LINEAR = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
SERVED = {"enable_lora": True, "max_lora_rank": 4, "lora_target_modules": ALL_LINEAR}
KEY = "test-key"


# ---- launcher args ------------------------------------------------------------------------------

def test_lora_fills_in_sglang_args_and_picks_the_disk_transport():
    cfg = build_config({}, [*SGLANG, *LORA])
    assert cfg.rollout.engine.server_args == SERVED  # all-linear: its names, not SGLang's "all" (lm_head too)
    assert cfg.rollout.weight_transport.kind == "disk"
    from miles_core.config import RunConfig

    assert RunConfig.model_validate(cfg.model_dump()) == cfg  # a resolved (dumped, reloaded) config validates again
    flags = server_arg_flags(cfg.rollout.engine.server_args)
    assert flags == ["--enable-lora", "--max-lora-rank", "4", "--lora-target-modules", *ALL_LINEAR]
    args = parse_args(["--model-path", "m", *flags])  # the stand-in takes them as SGLang's parser does
    assert args.enable_lora and args.max_lora_rank == "4" and args.lora_target_modules == ALL_LINEAR
    only_q = build_config({}, [*SGLANG, *LORA, "training.lora.target_modules=[q_proj, v_proj]"])
    assert only_q.rollout.engine.server_args["lora_target_modules"] == ["q_proj", "v_proj"]
    assert not build_config({}, LORA).rollout.engine.kind == "sglang"  # embedded engines: untouched
    assert "server_args" not in build_config({}, LORA).rollout.engine.model_dump()


@pytest.mark.parametrize("arg, kept", [
    ("max_lora_rank=16", {"max_lora_rank": 16}),
    ("lora_target_modules=[all]", {"lora_target_modules": ["all"]}),
    # SGLang's pool fuses q/k/v and gate/up: naming one admits adapters on the others
    ("lora_target_modules=[q_proj, o_proj, gate_proj, down_proj]",
     {"lora_target_modules": ["q_proj", "o_proj", "gate_proj", "down_proj"]}),
    ("max_loaded_loras=8", {"max_loaded_loras": 8}),
])
def test_compatible_user_args_are_kept(arg, kept):
    args = build_config({}, [*SGLANG, *LORA, f"rollout.engine.server_args.{arg}"]).rollout.engine.server_args
    assert args["enable_lora"] is True and {k: args[k] for k in kept} == kept


@pytest.mark.parametrize("overrides, message", [
    (["rollout.engine.server_args.max_lora_rank=2"], "max_lora_rank=2 is below training.lora.rank=4.*set it to 4"),
    (["rollout.engine.server_args.lora_target_modules=[q_proj]"], r"leaves out \['down_proj', 'gate_up_proj', "
                                                                  r"'o_proj'\].*add them"),
    (["rollout.engine.server_args.lora_target_modules=[all, q_proj]"], "takes 'all' only alone"),
    (["rollout.engine.server_args.enable_lora=false"], "remove rollout.engine.server_args.enable_lora=false"),
    (["rollout.engine.server_args.max_loaded_loras=1"], "max_loaded_loras=1.*set it to 8 or more"),
    (["rollout.weight_transport=broadcast"], "set rollout.weight_transport=disk \\(or auto\\), not broadcast"),
    (["placement.layout=colocated", "placement.time_sharing=true"], "set placement.time_sharing=false"),
])
def test_incompatible_user_args_say_how_to_fix(overrides, message):
    with pytest.raises(ConfigError, match=message):
        build_config({}, [*SGLANG, *LORA, *overrides])


# ---- the LoRA routes on the embedded server, through the client -----------------------------------

@pytest.fixture(scope="module")
def trained(tiny_model_dir, tmp_path_factory):
    """A LoRA trainer after two steps and its adapter in PEFT layout (export_adapter)."""
    cfg = build_config({}, LORA)
    trainer = FSDPTrainer(str(tiny_model_dir), cfg.training, cfg.algorithm, group_size=2)
    for seed in (1, 2):
        trainer.train_step(random_samples(4, seed=seed))
    folder = trainer.export_adapter(tmp_path_factory.mktemp("adapter") / "v2")
    yield trainer, folder
    trainer.close()


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with serve(tiny_model_dir, server_args=dict(SERVED), api_key=KEY, num_threads=1) as handle:
        yield handle


def _scores(client: SGLangClient, samples, **extra) -> list[list[float]]:
    """The engine's log-probs of each sample's response tokens (prefill scoring)."""
    out = []
    for s in samples:
        [r] = client.generate([s.prompt_ids + s.response_ids], {"max_new_tokens": 0, "temperature": 0.0},
                              logprob_start_len=len(s.prompt_ids), **extra)
        out.append([e[0] for e in r["meta_info"]["input_token_logprobs"]])
    return out


def test_an_adapter_loaded_by_name_serves_the_trainers_log_probs(server, trained):
    trainer, folder = trained
    client, samples = SGLangClient(server.url, api_key=KEY), random_samples(4, seed=3)
    base = _scores(client, samples)
    result = client.load_lora_adapter("policy-v2", str(folder))
    assert result["success"] and result["loaded_adapters"] == {"policy-v2": str(folder)}
    try:
        tuned = _scores(client, samples, lora_path="policy-v2")
        assert max_abs_diff(tuned, trainer.compute_logprobs(samples)) < 1e-4
        assert max_abs_diff(tuned, base) > 1e-3  # the adapter changed them
        assert max_abs_diff(_scores(client, samples), base) == 0  # no lora_path: the base, restored exactly
        with pytest.raises(EngineError, match="because it is already loaded") as refused:
            client.load_lora_adapter("policy-v2", str(folder))
        assert refused.value.status == 400
    finally:
        client.unload_lora_adapter("policy-v2")
    # SGLang loads an adapter it once had from its folder again when a request names it
    assert max_abs_diff(_scores(client, samples[:1], lora_path="policy-v2"), tuned[:1]) == 0
    client.unload_lora_adapter("policy-v2")


def test_sglangs_refusals(server, trained, tiny_model_dir, tmp_path):
    _, folder = trained
    client = SGLangClient(server.url, api_key=KEY)
    with pytest.raises(EngineError, match="LoRA adapter that has never been loaded: policy-v9") as refused:
        client.generate([[5, 6, 7]], {"max_new_tokens": 2}, lora_path="policy-v9")
    assert refused.value.status == 400
    with pytest.raises(EngineError, match="LoRA with name policy-v9 does not exist"):
        client.unload_lora_adapter("policy-v9")
    with pytest.raises(EngineError, match="not a PEFT adapter folder"):
        client.load_lora_adapter("missing", str(tmp_path / "nothing"))
    no_key = requests.post(server.url + "/load_lora_adapter", json={"lora_name": "x", "lora_path": str(folder)},
                           timeout=10)
    assert no_key.status_code == 401
    assert requests.post(server.url + "/load_lora_adapter", json={"lora_name": "x"}, timeout=10,
                         headers={"Authorization": f"Bearer {KEY}"}).status_code == 400  # lora_path required
    with serve(tiny_model_dir, server_args={**SERVED, "max_lora_rank": 2}, num_threads=1) as small:
        with pytest.raises(EngineError, match="with rank 4 is incompatible.*--max-lora-rank"):
            SGLangClient(small.url).load_lora_adapter("a", str(folder))
    with serve(tiny_model_dir, server_args={**SERVED, "lora_target_modules": ["o_proj"]}, num_threads=1) as narrow:
        with pytest.raises(EngineError, match="incompatible.*--lora-target-modules"):
            SGLangClient(narrow.url).load_lora_adapter("a", str(folder))
    with serve(tiny_model_dir, num_threads=1) as plain:  # launched without --enable-lora
        with pytest.raises(EngineError, match="LoRA is not enabled. Please set `--enable-lora`"):
            SGLangClient(plain.url).load_lora_adapter("a", str(folder))
        with pytest.raises(EngineError, match="'a' was requested, but LoRA is not enabled"):
            SGLangClient(plain.url).generate([[5, 6]], {"max_new_tokens": 1}, lora_path="a")


def test_max_loaded_loras_is_refused_not_evicted(tiny_model_dir, trained):
    _, folder = trained
    with serve(tiny_model_dir, server_args={**SERVED, "max_loaded_loras": 1}, num_threads=1) as handle:
        client = SGLangClient(handle.url)
        client.load_lora_adapter("a", str(folder))
        with pytest.raises(EngineError, match="--max-loaded-loras=1.*unload one first"):
            client.load_lora_adapter("b", str(folder))
        client.unload_lora_adapter("a")
        assert client.load_lora_adapter("b", str(folder))["loaded_adapters"] == {"b": str(folder)}


def test_the_router_names_the_synced_adapter_in_every_request(monkeypatch):
    from miles_core.rollout.engine_group import EngineGroup
    from miles_core.rollout.router import Router

    sent = []
    monkeypatch.setattr(SGLangClient, "generate", lambda self, ids, params, logprob, rid, **extra: sent.append(extra)
                        or [{}])
    group = EngineGroup.__new__(EngineGroup)  # use_lora_adapter reads only the router
    group.router = Router([SGLangClient("http://a"), SGLangClient("http://b")])
    group.router.generate([[1]], {})
    group.use_lora_adapter("policy-v3")  # what the adapter sync calls once every engine loaded it
    group.router.generate([[1]], {})
    group.router.generate([[1]], {}, lora_path="other")  # a caller's own choice is kept
    assert sent == [{}, {"lora_path": "policy-v3"}, {"lora_path": "other"}]
