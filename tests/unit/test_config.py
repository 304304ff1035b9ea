import pytest

from miles_core.config import ConfigError, RunConfig, build_config, field_docs, load_config
from tests.conftest import REPO


def test_local_recipe_validates_and_overrides_apply():
    cfg = load_config(REPO / "configs/local.yaml", ["training.lr=5e-4", "rollout.num_engines=2"])
    assert cfg.training.lr == 5e-4 and cfg.rollout.num_engines == 2
    assert cfg.model.source == "builtin:tiny-qwen3"


def test_unknown_field_is_named_with_a_fix():
    with pytest.raises(ConfigError) as err:
        build_config({"training": {"lr": 1e-3, "learning_rate": 1}})
    assert "training.learning_rate: unknown field" in str(err.value)


def test_bad_value_names_field_and_value():
    with pytest.raises(ConfigError) as err:
        build_config({}, ["rollout.num_samples_per_prompt=1"])
    message = str(err.value)
    assert "num_samples_per_prompt >= 2" in message


def test_wrong_type_reports_input():
    with pytest.raises(ConfigError) as err:
        build_config({}, ["training.num_steps=many"])
    assert "training.num_steps" in str(err.value) and "'many'" in str(err.value)


def test_malformed_override_explains_syntax():
    with pytest.raises(ConfigError, match="expected dotted.key=value"):
        build_config({}, ["training.lr"])


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("training: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_every_field_is_documented():
    docs = field_docs()
    undocumented = [name for name, _, doc in docs if not doc]
    assert undocumented == [] and len(docs) > 100
    assert {"training.lr", "warmup.target_pass_at_1", "algorithm.short_batch"} <= {name for name, _, _ in docs}


def test_digest_changes_with_content():
    assert RunConfig().digest() == RunConfig().digest()
    assert RunConfig().digest() != build_config({}, ["seed=7"]).digest()


def test_builtin_task_asking_for_more_distinct_problems_than_exist_is_refused():
    """Operands up to 9 give 100 pairs; the recipe's 4000 + 200 would fail only in prepare-data."""
    with pytest.raises(ConfigError) as err:
        build_config({}, ["data.builtin.max_operand=9"])
    assert "data.builtin: " in str(err.value)
    assert "num_train + num_eval = 4200" in str(err.value) and "max_operand=9 gives at most 100" in str(err.value)
    assert "raise max_operand to 64 or more" in str(err.value)
    build_config({}, ["data.builtin.max_operand=9", "data.builtin.num_train=90", "data.builtin.num_eval=10"])


def test_column_addition_task_counts_its_distinct_problems():
    """One digit gives 9 x 9 = 81 pairs: more is refused before prepare-data."""
    with pytest.raises(ConfigError, match="digits=1 gives at most 81"):
        build_config({}, ["data.builtin.kind=column_addition", "data.builtin.digits=1"])
    build_config({}, ["data.builtin.kind=column_addition", "data.builtin.digits=1", "data.builtin.num_train=80",
                      "data.builtin.num_eval=1"])


def test_hf_source_shape_and_sglang_needs_gpu():
    with pytest.raises(ConfigError, match="hf://org/repo"):
        build_config({"model": {"source": "hf://justrepo"}})
    with pytest.raises(ConfigError, match="gpus_per_engine"):
        build_config({"rollout": {"engine": "sglang", "weight_transport": "broadcast"}})
    with pytest.raises(ConfigError, match="weight_transport=broadcast"):
        build_config({"rollout": {"engine": "sglang", "gpus_per_engine": 1, "weight_transport": "object_store"}})
    with pytest.raises(ConfigError, match="shared_memory transport cannot reach"):
        build_config({"rollout": {"engine": "sglang", "gpus_per_engine": 1, "weight_transport": "shared_memory"}})


def test_shared_memory_transport_needs_trainer_and_engines_on_one_device():
    shared = ["rollout.weight_transport=shared_memory"]
    with pytest.raises(ConfigError, match="one machine: set placement.layout=colocated"):  # SPREAD: other nodes
        build_config({}, shared)
    cpu = build_config({}, shared + ["placement.layout=colocated"])
    assert cpu.rollout.weight_transport.kind == "shared_memory"
    with pytest.raises(ConfigError, match="GPUs .* or neither"):
        build_config({}, shared + ["rollout.gpus_per_engine=0.4"])
    one_gpu = shared + ["rollout.gpus_per_engine=0.4", "training.gpus_per_trainer=0.5"]
    with pytest.raises(ConfigError, match="placement.layout=colocated"):
        build_config({}, one_gpu)
    assert build_config({}, one_gpu + ["placement.layout=colocated"]).placement.layout == "colocated"
    with pytest.raises(ConfigError, match="on one GPU"):
        build_config({}, one_gpu + ["placement.layout=colocated", "rollout.num_engines=2"])


def test_cuda_ipc_transport_needs_sglang_beside_the_trainer_on_one_gpu():
    ipc = ["rollout.engine=sglang", "rollout.weight_transport=cuda_ipc"]
    with pytest.raises(ConfigError, match="one GPU to share"):  # the trainer on CPU
        build_config({}, ipc + ["rollout.gpus_per_engine=1"])
    one_gpu = ipc + ["rollout.gpus_per_engine=0.5", "training.gpus_per_trainer=0.5"]
    with pytest.raises(ConfigError, match="placement.layout=colocated"):
        build_config({}, one_gpu)
    cfg = build_config({}, one_gpu + ["placement.layout=colocated"])
    assert (cfg.rollout.weight_transport.kind, cfg.rollout.weight_transport.bucket_megabytes) == ("cuda_ipc", 512)
    with pytest.raises(ConfigError, match="on one GPU"):
        build_config({}, one_gpu + ["placement.layout=colocated", "rollout.num_engines=2"])
    with pytest.raises(ConfigError, match="use it with rollout.engine=sglang"):  # embedded engines: shared_memory
        build_config({}, ["rollout.weight_transport=cuda_ipc", "rollout.gpus_per_engine=0.5",
                          "training.gpus_per_trainer=0.5", "placement.layout=colocated"])
    with pytest.raises(ConfigError, match="gpus_per_engine >= 1"):  # a fraction of a GPU only beside the trainer
        build_config({}, ["rollout.engine=sglang", "rollout.weight_transport=broadcast", "rollout.gpus_per_engine=0.5"])


@pytest.mark.parametrize(("overrides", "chosen", "slower"), [
    ([], "object_store", "disk"),  # no GPU placed
    (["training.gpus_per_trainer=0.5", "rollout.gpus_per_engine=0.4", "placement.layout=colocated"], "shared_memory",
     "object_store"),
    (["training.gpus_per_trainer=0.5", "rollout.gpus_per_engine=0.4", "placement.layout=colocated",
      "rollout.engine=sglang"], "cuda_ipc", None),
    (["training.gpus_per_trainer=1", "rollout.gpus_per_engine=1"], "broadcast", "object_store"),
    (["training.gpus_per_trainer=1", "rollout.gpus_per_engine=1", "rollout.engine=sglang"], "broadcast", "disk"),
    (["training.gpus_per_trainer=1", "rollout.gpus_per_engine=2",
      "rollout.engine={kind: sglang, server_args: {dp_size: 2}}"], "disk", None),
])
def test_auto_transport_is_the_fastest_the_placement_allows(overrides, chosen, slower):
    """The default: a GPU user who keeps it never gets the object store's trip through host memory."""
    from flows.cli import transport_text

    cfg = build_config({}, overrides)
    assert cfg.rollout.weight_transport.kind == chosen
    assert build_config({}, [*overrides, f"rollout.weight_transport={chosen}"]) == cfg
    assert transport_text(cfg).startswith(f"{chosen} (") and "auto would choose" not in transport_text(cfg)
    if slower:  # `miles plan` says when a recipe picks another transport than auto would
        assert f"auto would choose {chosen}" in transport_text(
            build_config({}, [*overrides, f"rollout.weight_transport={slower}"]))


def test_broadcast_is_refused_where_ranks_may_share_a_gpu():
    """NCCL refuses two ranks of a group on one GPU (measured against SGLang 0.5.17 on an H100)."""
    shared_gpu = ["training.gpus_per_trainer=0.5", "rollout.gpus_per_engine=0.4", "placement.layout=colocated"]
    for engine in ("embedded", "sglang"):
        with pytest.raises(ConfigError, match="Duplicate GPU detected|sglang engine needs a GPU"):
            build_config({}, [*shared_gpu, f"rollout.engine={engine}", "rollout.weight_transport=broadcast"])
    whole = build_config({}, ["training.gpus_per_trainer=1", "rollout.gpus_per_engine=1", "rollout.weight_transport=broadcast"])
    assert whole.rollout.weight_transport.kind == "broadcast"


def test_sglang_beside_the_trainer_loads_from_disk_too():
    """LoRA adapters reach SGLang by disk, so a one-GPU LoRA run puts the engine beside the trainer."""
    shared_gpu = ["training.gpus_per_trainer=0.5", "rollout.gpus_per_engine=0.4", "placement.layout=colocated",
                  "rollout.engine=sglang"]
    assert build_config({}, [*shared_gpu, "rollout.weight_transport=disk"]).rollout.gpus_per_engine == 0.4
    lora = build_config({}, [*shared_gpu, "training.lora.rank=8"])
    assert lora.rollout.weight_transport.kind == "disk" and lora.rollout.engine.server_args["enable_lora"]


def test_sglang_python_must_be_absolute():
    cfg = build_config({}, ["rollout.engine={kind: sglang, python: /opt/sglang/bin/python}", "rollout.gpus_per_engine=1"])
    assert cfg.rollout.engine.python == "/opt/sglang/bin/python"
    with pytest.raises(ConfigError, match="rollout.engine.sglang.python.*absolute path"):
        build_config({}, ["rollout.engine={kind: sglang, python: venv/bin/python}", "rollout.gpus_per_engine=1"])


def test_sglang_server_args_and_sync_checks_fail_at_validation():
    sglang = {"engine": {"kind": "sglang", "server_args": {"cuda_graph_max_bs": 8}}, "gpus_per_engine": 1,
              "weight_transport": "broadcast"}
    with pytest.raises(ConfigError, match=r"rollout.engine.sglang.server_args.*'cuda_graph_max_bs'.*0.5.16, 0.5.17 and 0.5.23"):
        build_config({"rollout": sglang})
    sglang["engine"]["server_args"] = {"tp_size": 2}
    assert build_config({"rollout": sglang}).rollout.engine.server_args == {"tp_size": 2}
    with pytest.raises(ConfigError, match="verify_weight_sync=false for engine sglang"):
        build_config({"rollout": sglang | {"verify_weight_sync": True}})
    for arg in ("dp_size", "pp_size"):  # SGLang's weight-update group counts tp_size ranks only
        with pytest.raises(ConfigError, match=f"server_args.{arg}=1"):
            build_config({"rollout": sglang | {"engine": {"kind": "sglang", "server_args": {arg: 2}}}})
        disk = sglang | {"engine": {"kind": "sglang", "server_args": {arg: 2}}, "weight_transport": "disk"}
        assert build_config({"rollout": disk}).rollout.engine.server_args == {arg: 2}


# ---- Megatron section and `miles plan` on every recipe ----------------------------------------------
@pytest.mark.parametrize("recipe", sorted(p.name for p in (REPO / "configs").glob("*.yaml")))
def test_miles_plan_on_every_recipe(recipe):
    from typer.testing import CliRunner

    from flows.cli import app

    # the cluster recipes' models and data are not on this machine: the recipe alone is checked
    result = CliRunner().invoke(app, ["plan", str(REPO / "configs" / recipe), "--skip-preflight"], terminal_width=200)
    assert result.exit_code == 0, result.output
    for row in ("trainer parallelism", "bundle 0", "total per trainer GPU", "optimizer"):
        assert row in result.output, row


def test_tensor_parallel_layout_plans_one_bundle_per_trainer_rank():
    from miles_core.driver.placement import bundles, describe

    cfg = build_config({}, ["training.backend=megatron", "training.megatron.tensor_parallel_size=4",
                            "training.gpus_per_trainer=4", "training.cpus_per_trainer=16", "rollout.num_engines=2"])
    assert cfg.training.world_size == 4
    # gpus/cpus_per_trainer are totals: one GPU and 4 CPUs per rank, engines after them
    assert bundles(cfg)[:4] == [{"CPU": 4.0, "GPU": 1.0}] * 4 and len(bundles(cfg)) == 6
    rows = dict(describe(cfg))
    assert "a group of 4 trainer actors" in rows["trainer parallelism"]
    assert rows["bundle 3"].startswith("trainer rank 3") and rows["bundle 4"].startswith("engine rank 0")


def test_expert_parallel_layout_plans_one_rank_per_gpu_with_dense_data_parallel():
    from miles_core.driver.placement import describe

    cfg = build_config({}, ["training.backend=megatron", "training.megatron.expert_parallel_size=8",
                            "training.gpus_per_trainer=8", "training.cpus_per_trainer=32"])
    assert cfg.training.world_size == 8
    assert "ep=8 dp=8 (a group of 8 trainer actors)" in dict(describe(cfg))["trainer parallelism"]


def test_megatron_layouts_not_implemented_say_how_to_fix():
    with pytest.raises(ConfigError, match="pipeline_parallel_size=1"):
        build_config({}, ["training.megatron.pipeline_parallel_size=2"])
    with pytest.raises(ConfigError, match="context_parallel_size=1"):
        build_config({}, ["training.megatron.context_parallel_size=2"])
    cfg = build_config({}, ["training.backend=megatron", "training.megatron.tensor_parallel_size=2"])
    assert cfg.training.world_size == 2  # a trainer group of 2 ranks
    assert build_config({}, ["training.megatron.tensor_parallel_size=2"]).training.world_size == 1  # fsdp2
    with pytest.raises(ConfigError, match="gpus_per_trainer=2"):
        build_config({}, ["training.backend=megatron", "training.megatron.tensor_parallel_size=2",
                          "training.gpus_per_trainer=1"])
    # the Megatron trainer broadcasts like FSDP's (rank 0 sends what the group gathered)
    megatron = build_config({}, ["training.backend=megatron", "rollout.weight_transport=broadcast"])
    assert megatron.rollout.weight_transport.kind == "broadcast"


def test_megatron_options_read_the_config_section():
    pytest.importorskip("megatron.core")
    from miles_core.training.megatron.trainer import MegatronOptions

    cfg = build_config({}, ["training.backend=megatron", "training.megatron.recompute_activations=true",
                            "training.megatron.logprob_chunk_tokens=512"])
    opts = MegatronOptions.from_training(cfg.training)
    assert (opts.tp, opts.pp, opts.ep, opts.recompute, opts.logprob_chunk_tokens) == (1, 1, 1, True, 512)


def test_variants_carry_their_own_fields():
    # A variant's fields exist only under its kind: a fully-async knob on a sync loop, or a
    # bucket size on the disk transport, cannot be written.
    with pytest.raises(ConfigError, match=r"rollout.loop.sync.max_weight_staleness: unknown field"):
        build_config({"rollout": {"loop": {"kind": "sync", "max_weight_staleness": 2}}})
    with pytest.raises(ConfigError, match=r"rollout.weight_transport.disk.bucket_megabytes: unknown field"):
        build_config({}, ["rollout.weight_transport=disk", "rollout.weight_transport.bucket_megabytes=64"])
    with pytest.raises(ConfigError, match=r"rollout.loop: which kind\? set rollout.loop.kind"):
        build_config({}, ["rollout.loop.max_weight_staleness=2"])
    with pytest.raises(ConfigError, match="does not match any of the expected tags: 'sync', 'one_step_off'"):
        build_config({}, ["rollout.loop=bogus"])


def test_a_variant_can_be_written_as_its_kind_and_extended_with_set():
    cfg = build_config({"rollout": {"loop": "fully_async"}},
                       ["rollout.loop.max_weight_staleness=3", "algorithm.correction.kind=tis"])
    assert (cfg.rollout.loop.kind, cfg.rollout.loop.max_weight_staleness) == ("fully_async", 3)
    assert cfg.model_dump()["rollout"]["loop"] == {"kind": "fully_async", "max_weight_staleness": 3,
                                                   "stale_policy": "drop", "buffer_batches": 1}
    assert RunConfig.model_validate(cfg.model_dump()) == cfg  # the resolved config round-trips
    rows = {name: doc for name, _, doc in field_docs()}
    assert rows["rollout.loop.kind"].startswith("one of sync | one_step_off | fully_async")
    bucket_docs = [doc for name, _, doc in field_docs() if name == "rollout.weight_transport.bucket_megabytes"]
    assert [doc.split(")")[0] for doc in bucket_docs] == ["(broadcast only", "(cuda_ipc only"]


# ---- recipes that would silently mean something else fail with the reason ------------------------------
@pytest.mark.parametrize("content, message", [
    (b"", "is empty"),
    (b"training:\n  lr: 1.0e-3\ntraining:\n  num_steps: 3\n", "key 'training' is written twice"),
    (b"training:\n  lr: 1.0e-3\n  lr: 2.0e-3\n", "key 'lr' is written twice"),
    (b"training:\n  num_steps: true\n", r"training\.num_steps: Input should be a valid integer.*got 'true'"),
    (b"eval:\n  pass_k: [1, -1]\n", r"eval\.pass_k\.1: Input should be greater than or equal to 1"),
    (b"training:\n  lr: .inf\n", "training.lr: Input should be a finite number"),
    (b"a: &x [1, 2]\nb: [*x, *x]\n", "aliases"),
    (b"\xff\xfe\x00", "not UTF-8"),
])
def test_recipe_mistakes_are_errors(tmp_path, content, message):
    path = tmp_path / "recipe.yaml"
    path.write_bytes(content)
    with pytest.raises(ConfigError, match=message):
        load_config(path)


def test_malformed_set_value_is_an_error_not_a_traceback():
    with pytest.raises(ConfigError, match="not valid YAML"):
        build_config({}, ["training.lr=[1,"])


def test_credentials_in_a_url_are_refused_wherever_they_are():
    for override in ("storage.object_store_uri=s3://AKIA:s3cr3t@minio:9000/bucket",
                     "tracking.tracking_uri=postgresql://mlflow:pw@db/mlflow",
                     "eval.external_command='curl https://user:pw@host/x'"):
        with pytest.raises(ConfigError, match="credentials in a URL") as err:
            build_config({}, [override])
        assert "s3cr3t" not in str(err.value) and "pw@" not in str(err.value) and "environment" in str(err.value)
    assert build_config({}, ["storage.object_store_uri=s3://bucket/prefix"]).storage.object_store_uri
