"""The run's schema: one section per concern, composed into RunConfig."""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, ValidationError, model_validator

from miles_core.config.algorithm import GROUP_ALGORITHMS, AlgorithmConfig
from miles_core.config.base import Section
from miles_core.config.lora import check_lora_engines
from miles_core.config.precision import check_precision
from miles_core.config.rollout import RolloutConfig
from miles_core.config.training import TrainingConfig
from miles_core.config.transport import check_transport, resolve_auto_transport


class TinyModelConfig(Section):
    hidden_size: int = Field(96, ge=8)
    """Width of the built-in Qwen3-architecture model."""
    num_layers: int = Field(4, ge=1)
    """Number of decoder layers of the built-in model."""
    num_attention_heads: int = Field(4, ge=1)
    """Query heads of the built-in model (must divide hidden_size)."""
    num_key_value_heads: int = Field(2, ge=1)
    """Key/value heads (grouped-query attention; must divide num_attention_heads)."""
    intermediate_size: int = Field(256, ge=8)
    """MLP width of the built-in model."""
    max_positions: int = Field(256, ge=16)
    """Context length of the built-in model (prompt + response tokens)."""
    seed: int = 0
    """Seed of the random initialisation, part of the built-in model's identity."""

    @model_validator(mode="after")
    def _heads_divide(self) -> TinyModelConfig:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("hidden_size must be a multiple of num_attention_heads")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        return self


class ModelConfig(Section):
    source: str = "builtin:tiny-qwen3"
    """Where the starting model comes from: `builtin:tiny-qwen3` (built here), a local
    directory, `hf://org/repo@revision` (Hugging Face Hub), or any fsspec URL such as
    `s3://bucket/path` or `file:///abs/path` pointing at an HF-format directory."""
    tiny: TinyModelConfig = TinyModelConfig()
    """Shape of the built-in model; ignored for other sources."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Parameter dtype of trainer and engine. float32 on CPU."""
    request_timeout_seconds: float = Field(60.0, gt=0)
    """Connect and read timeout of each request to a remote model source (s3://, other fsspec
    URLs), so a store that accepts connections but never answers fails the stage."""

    @model_validator(mode="after")
    def _known_scheme(self) -> ModelConfig:
        src = self.source
        if src.startswith("builtin:") and src != "builtin:tiny-qwen3":
            raise ValueError(f"unknown built-in model {src!r}; the only one is 'builtin:tiny-qwen3'")
        if src.startswith("hf://") and "/" not in src[len("hf://"):]:
            raise ValueError("hf:// sources look like 'hf://org/repo' or 'hf://org/repo@revision'")
        return self


class ArithmeticTaskConfig(Section):
    kind: Literal["addition", "column_addition"] = "addition"
    """`addition`: `a+b=` answered with the sum alone (a few tokens; exact_match reward).
    `column_addition`: two `digits`-digit numbers added column by column in a worked
    scratchpad that ends `Answer: <sum>` (DAPO's answer line; ~14 tokens per digit), with the
    worked solution in each row's `solution` field for the SFT warm-up."""
    num_train: int = Field(4000, ge=1)
    """Training problems generated for the built-in task."""
    num_eval: int = Field(200, ge=1)
    """Held-out problems (disjoint from training) for evaluation."""
    max_operand: int = Field(99, ge=1)
    """addition: operands are drawn from [0, max_operand]."""
    digits: int = Field(8, ge=1, le=18)
    """column_addition: digits of each operand (both have exactly this many)."""
    seed: int = 1234
    """Seed of the problem generator, part of the dataset's identity."""

    def distinct_problems(self) -> int:
        """How many distinct (a, b) pairs the task can draw from."""
        if self.kind == "column_addition":
            return (9 * 10 ** (self.digits - 1)) ** 2
        return (self.max_operand + 1) ** 2

    @model_validator(mode="after")
    def _enough_distinct_problems(self) -> ArithmeticTaskConfig:
        """Train and held-out problems are distinct pairs (a, b): refused here, a recipe asking
        for more would pass `miles plan` and the preflight and fail only in prepare-data."""
        available, needed = self.distinct_problems(), self.num_train + self.num_eval
        if needed > available and self.kind == "column_addition":
            raise ValueError(f"num_train + num_eval = {needed} distinct problems, but digits={self.digits} gives at "
                             f"most {available}: raise digits or lower num_train + num_eval")
        if needed > available:
            least = math.isqrt(needed - 1)  # the smallest m with (m + 1)^2 >= needed
            raise ValueError(
                f"num_train + num_eval = {needed} distinct problems, but max_operand={self.max_operand} gives at "
                f"most {available} ((max_operand + 1)^2 pairs): lower num_train + num_eval to {available} or less, "
                f"or raise max_operand to {least} or more")
        return self


class DataConfig(Section):
    train_path: str | None = None
    """DAPO-style jsonl of training prompts; None generates the built-in addition task."""
    eval_path: str | None = None
    """jsonl of held-out prompts in the same format; None uses the built-in held-out split."""
    builtin: ArithmeticTaskConfig = ArithmeticTaskConfig()
    """Size and seed of the built-in addition task."""
    prompt_key: str = "prompt"
    """Row key of the prompt: a list of chat messages or a plain string."""
    label_key: str = "label"
    """Row key of the reference answer (falls back to reward_model.ground_truth)."""
    solution_key: str = "solution"
    """Row key of a worked solution: the SFT warm-up trains on it where a row has one (the
    label alone otherwise). RL rewards only the answer, so rows without it are fine."""
    apply_chat_template: bool = True
    """Render chat-message prompts with the tokenizer's chat template."""
    max_prompt_tokens: int = Field(1024, ge=1)
    """Prompts longer than this are skipped when the dataset is read (and counted)."""
    max_new_tokens_key: str | None = None
    """Row key of a prompt's own generation budget (an integer >= 1) overriding
    rollout.max_new_tokens for its samples; rows without the key use the recipe's. None: ignore
    any such key. Benches use it to script a long tail of response lengths."""


class WarmupConfig(Section):
    sft_steps: int = Field(60, ge=0)
    """Supervised steps on the training labels before RL (at most, with target_pass_at_1);
    0 skips the warm-up."""
    batch_size: int = Field(64, ge=1)
    """Examples per warm-up step."""
    lr: float = Field(3e-3, gt=0)
    """Learning rate of the warm-up."""
    target_pass_at_1: float | None = Field(None, gt=0, le=1)
    """Stop the warm-up once greedy pass@1 on the probe prompts reaches this (checked every
    check_interval_steps), so RL starts from a known level whatever the machine: small models
    learn a task in a sudden jump whose timing floating-point noise shifts by hundreds of
    steps, and a fixed step count then lands anywhere from 3% to 50%. None trains exactly
    sft_steps."""
    check_interval_steps: int = Field(10, ge=1)
    """Steps between probe evaluations when target_pass_at_1 is set."""
    num_probe_prompts: int = Field(200, ge=1)
    """Training prompts held out of the warm-up (a seeded sample) to measure target_pass_at_1
    on; RL still trains on them."""


class PlacementConfig(Section):
    ray_address: str | None = None
    """Ray cluster to join (`ray://host:10001` or `host:6379`); None starts a local one."""
    num_cpus: int | None = None
    """CPUs given to a local Ray (None: all of this machine)."""
    layout: Literal["colocated", "disaggregated"] = "disaggregated"
    """colocated: trainer and engines packed onto one node (STRICT_PACK); disaggregated:
    spread over nodes (SPREAD). Bundle 0 is the trainer, bundles 1..N the engines, in rank order."""
    trainer_resources: dict[str, float] = {}
    """Extra (custom) Ray resources the trainer bundle requires, e.g. {"trainer_node": 1}."""
    engine_resources: dict[str, float] = {}
    """Extra (custom) Ray resources each engine bundle requires, e.g. {"rollout_node": 1}."""
    ready_timeout_seconds: float = Field(600.0, gt=0)
    """How long to wait for the cluster to fit the placement group before failing."""
    time_sharing: bool = False
    """Trainer and engines take turns on the same GPUs: each step the trainer's parameters,
    gradients and optimizer states leave the device (to pinned host memory) while the engines
    generate, and the engines release their weights and KV cache while the trainer trains. Costs
    the offload/onload copies each step (time/offload_seconds, time/onload_seconds); buys room for
    a model whose trainer and engines do not fit a GPU together. Needs layout=colocated and
    rollout.loop=sync."""
    driver: Literal["inline", "ray_job"] = "inline"
    """Where the training driver runs: inline in the train task's process, or as a Ray Job on
    the cluster (Jobs API at ray_jobs_address) that outlives the task's process; a retried
    task re-attaches to the run's live job instead of starting a second driver."""
    ray_jobs_address: str | None = None
    """Ray Jobs API (dashboard) URL for driver=ray_job, e.g. `http://head:8265`; None uses
    $RAY_API_SERVER_ADDRESS (`miles stack up` sets it)."""
    job_python: str | None = None
    """Python interpreter of the driver job on the cluster; None uses this process's
    interpreter path (right for the local stack and for images that install the project
    where the worker's image does)."""
    job_stall_seconds: float = Field(1800.0, gt=0)
    """A driver job that completes no RL step for this long (model loading included) is
    stopped and the task fails with a retryable DriverStalled."""
    job_poll_seconds: float = Field(2.0, gt=0)
    """How often the train task polls the driver job's status, logs and progress."""


class CheckpointConfig(Section):
    interval_steps: int = Field(10, ge=1)
    """Save a checkpoint every this many RL steps (and always after the last)."""
    keep_latest: int = Field(2, ge=1)
    """Complete checkpoints kept in the run directory; older ones are pruned."""
    store_keep_latest: int = Field(3, ge=1)
    """Complete checkpoints kept in the object store (runs/<run_key>/checkpoints/); older ones
    are pruned after each upload, never the one latest.json points to."""
    upload_part_megabytes: int = Field(64, ge=5)
    """Part size (MiB) of multipart uploads to S3; files of at least twice this size go up in
    parts (S3's minimum part is 5 MiB)."""
    upload_attempts: int = Field(8, ge=1)
    """Attempts per uploaded file (and per latest.json write) before the checkpoint's upload
    fails; retries wait with exponential backoff and jitter."""
    upload_backoff_seconds: float = Field(2.0, gt=0)
    """Wait before the first upload retry; doubled on each further retry (capped at 60 s)."""
    upload_timeout_seconds: float = Field(60.0, gt=0)
    """Connect and read timeout of each object-store request, so a hung store cannot hang the run."""
    upload_wait_seconds: float = Field(1800.0, gt=0)
    """How long the train task waits at its end for queued checkpoint uploads to finish."""


class EvalDatasetConfig(Section):
    name: str
    """Name used in metric keys (eval/<phase>/<name>/pass_at_k)."""
    path: str
    """jsonl in the DAPO layout (prompt + label), e.g. an AIME-2024-style file."""
    reward: str | None = None
    """Reward function for this dataset; None uses rollout.reward."""
    num_samples_per_prompt: int = Field(1, ge=1)
    """n responses per prompt; pass@k is estimated for k <= n (unbiased estimator)."""
    temperature: float = Field(0.0, ge=0)
    """Sampling temperature; 0 is greedy (then n must be 1)."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling threshold."""
    max_new_tokens: int | None = Field(None, ge=1)
    """Generation budget; None uses eval.max_new_tokens."""

    @model_validator(mode="after")
    def _greedy_is_single(self) -> EvalDatasetConfig:
        if self.temperature == 0 and self.num_samples_per_prompt != 1:
            raise ValueError("greedy (temperature=0) gives one response per prompt: set num_samples_per_prompt=1 "
                             "or temperature>0")
        return self


class EvalConfig(Section):
    max_new_tokens: int = Field(8, ge=1)
    """Generation budget of evaluation responses."""
    batch_size: int = Field(256, ge=1)
    """Sequences (prompt x sample) per generation batch during evaluation."""
    pass_k: list[Annotated[int, Field(ge=1)]] = [1]
    """k values of pass@k reported for each dataset (only those <= its num_samples_per_prompt)."""
    use_rollout_generate: bool = False
    """Evaluate episodes of rollout.generate (e.g. multi-turn: the final answer is scored) instead
    of one engine call per sample."""
    datasets: list[EvalDatasetConfig] = []
    """Extra held-out datasets evaluated before and after training, besides data.eval_path."""
    interval_steps: int = Field(0, ge=0)
    """Evaluate every dataset (held-out + eval.datasets) every this many RL steps during
    training, logged as eval/periodic/<dataset>/pass_at_k at that step; 0 disables."""
    periodic_engines: Literal["rollout", "dedicated"] = "rollout"
    """Where periodic eval generates (eval.mode=local_engine): on the rollout engines, pausing
    rollout while it runs, or on eval.num_dedicated_engines extra engines that get the step's
    weights and evaluate in the background while training goes on."""
    num_dedicated_engines: int = Field(1, ge=1)
    """Engines started for periodic_engines=dedicated, each with the rollout engines' per-engine
    CPUs/GPUs, scheduled outside the run's placement group."""
    mode: Literal["local_engine", "external_command"] = "local_engine"
    """Where evaluation generates: an engine built from the model directory, or an external command."""
    external_command: str | None = None
    """For mode=external_command: a command with {model_dir} and {output_json} placeholders
    that writes {"pass@1": ...} (and any other metrics) to output_json."""


class TrackingConfig(Section):
    tracking_uri: str | None = None
    """MLflow tracking URI; None uses `sqlite:///<work_dir>/mlflow.db` (or MLFLOW_TRACKING_URI)."""
    experiment_name: str = "rl-posttrain"
    """MLflow experiment of the runs."""
    registered_model_name: str = "miles-tiny"
    """Model registry name under which each finished run's HF export is a new version."""
    promote: bool = True
    """After registration, move the `champion` alias to the new version if it passes the gate."""
    promote_min_score: float = 0.0
    """Gate floor: held-out pass@1 the candidate must reach to become champion."""
    promote_min_improvement: float = 0.0
    """Gate margin: how much the candidate must beat the current champion's pass@1 by."""
    system_metrics_interval_seconds: float = Field(10.0, ge=0)
    """Sample MLflow system metrics (CPU, memory, disk, network, GPU) into the run every this
    many seconds while training runs; 0 turns them off."""
    log_interval_steps: int = Field(10, ge=1)
    """Write a progress line (step, reward, latest eval, step time) to the log every this many
    steps, and at the last step: a log file has no progress bar."""


class StorageConfig(Section):
    work_dir: str = ".miles"
    """Local directory for caches, run directories, and the default MLflow/object store."""
    object_store_uri: str | None = None
    """Where checkpoints and exports are uploaded (`s3://bucket/prefix`, `file:///abs`, ...);
    None means $MILES_OBJECT_STORE_URI when set (the local stack's env file sets it), else
    `file://<work_dir>/store`."""

    @property
    def work_path(self) -> Path:
        """work_dir made absolute: its paths go to Ray actors and jobs whose working directory
        is not this process's."""
        return Path(self.work_dir).resolve()

    def cache_dir(self, kind: str) -> Path:
        """<work_dir>/cache/<kind> (models, data, warmup, megatron), absolute."""
        return self.work_path / "cache" / kind

    def store_uri(self) -> str:
        """The object store in effect: object_store_uri, else $MILES_OBJECT_STORE_URI (the local
        stack's env file sets it), else file://<work_dir>/store."""
        return self.object_store_uri or os.environ.get("MILES_OBJECT_STORE_URI") or (self.work_path / "store").as_uri()


def _strings(tree: object, prefix: str = "") -> list[tuple[str, str]]:
    """(dotted name, value) of every string in a config dump, lists included."""
    if isinstance(tree, dict):
        return [item for key, value in tree.items() for item in _strings(value, f"{prefix}{key}.")]
    if isinstance(tree, list):
        return [item for i, value in enumerate(tree) for item in _strings(value, f"{prefix}{i}.")]
    return [(prefix.rstrip("."), tree)] if isinstance(tree, str) else []


class RunConfig(Section):
    """One recipe: everything a run needs, nothing implicit."""

    seed: int = 42
    """Seed of sampling, data order and training."""
    model: ModelConfig = ModelConfig()
    """The starting model."""
    data: DataConfig = DataConfig()
    """Training and held-out prompts."""
    warmup: WarmupConfig = WarmupConfig()
    """Short supervised warm-up before RL."""
    rollout: RolloutConfig = RolloutConfig()
    """Generation of training samples."""
    training: TrainingConfig = TrainingConfig()
    """Optimisation and trainer resources."""
    algorithm: AlgorithmConfig = AlgorithmConfig()
    """The RL objective."""
    placement: PlacementConfig = PlacementConfig()
    """Which Ray cluster runs the actors."""
    checkpoint: CheckpointConfig = CheckpointConfig()
    """Periodic checkpoints."""
    eval: EvalConfig = EvalConfig()
    """Held-out evaluation before and after RL."""
    tracking: TrackingConfig = TrackingConfig()
    """MLflow tracking and registry."""
    storage: StorageConfig = StorageConfig()
    """Local work directory and the object store."""

    @model_validator(mode="after")
    def _sections_fit(self) -> RunConfig:
        """Checks that span sections, one per concern."""
        resolve_auto_transport(self)
        self._groups_fit()
        self._off_policy_fits()
        self._partial_fits()
        check_transport(self)
        check_lora_engines(self)
        self._routing_replay_fits()
        self._teacher_fits()
        self._time_sharing_fits()
        check_precision(self)
        if self.eval.use_rollout_generate and not self.rollout.generate:
            raise ValueError("eval.use_rollout_generate evaluates with rollout.generate, which is not set: set it "
                             "(package.module:function) or eval.use_rollout_generate=false")
        self._no_credentials_in_urls()
        return self

    def _no_credentials_in_urls(self) -> None:
        """A recipe and its --set values are logged, tracked and stored as flow parameters:
        credentials belong in the environment, never in a URL's user:password@."""
        for name, value in _strings(self.model_dump(mode="json")):
            if re.search(r"://[^/@\s]+@", value):
                raise ValueError(f"{name} holds credentials in a URL (user:password@host): remove them and set them "
                                 "in the environment instead (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, "
                                 "MLFLOW_TRACKING_URI, HF_TOKEN, ...)")

    def _groups_fit(self) -> None:
        if self.algorithm.name in GROUP_ALGORITHMS and self.rollout.num_samples_per_prompt < 2:
            raise ValueError(f"{self.algorithm.name} compares samples within a group: set "
                             "rollout.num_samples_per_prompt >= 2")

    def _off_policy_fits(self) -> None:
        a = self.algorithm
        if (self.rollout.loop.kind != "sync" and a.name != "sft" and a.correction.kind == "none"
                and a.old_logprob_source == "trainer"):
            raise ValueError(f"rollout.loop={self.rollout.loop.kind} trains on off-policy samples: set "
                             "algorithm.correction.kind=tis (or icepop/mis) or algorithm.old_logprob_source=rollout")

    def _partial_fits(self) -> None:
        """rollout.partial continues samples across weight updates: only the fully async loop
        updates weights while samples are in flight, and their tokens mix versions, which only a
        per-token correction against each token's behaviour log-prob handles."""
        r, a = self.rollout, self.algorithm
        if not r.partial.enabled:
            return
        if r.loop.kind != "fully_async":
            raise ValueError(f"rollout.partial.enabled needs rollout.loop=fully_async (it is {r.loop.kind}): only "
                             "the fully async loop updates weights while samples are in flight; set "
                             "rollout.loop.kind=fully_async or rollout.partial.enabled=false")
        if a.correction.kind not in ("tis", "mis"):
            raise ValueError("rollout.partial.enabled trains on samples whose tokens come from several weight "
                             f"versions: set algorithm.correction.kind=tis or mis (it is {a.correction.kind}), with "
                             "algorithm.old_logprob_source=trainer, so each token is weighed against its own "
                             "behaviour log-prob")
        unsupported = [name for name, value in (("rollout.generate", r.generate), ("rollout.remote_reward",
                       r.remote_reward), ("rollout.sample_filter", r.sample_filter), ("rollout.group_filter",
                       r.group_filter), ("algorithm.dynamic_sampling", a.dynamic_sampling),
                       ("training.megatron.routing_replay", self.routing_replay)) if value]
        if unsupported:
            raise ValueError("rollout.partial.enabled continues the default generation's samples, scores them with "
                             "a local reward and trains every finished group (a cut sample has no routed experts "
                             "to replay): unset "
                             f"{', '.join(unsupported)}, or set rollout.partial.enabled=false")

    def _time_sharing_fits(self) -> None:
        """Time-sharing hands the GPUs back and forth each step: nothing may overlap rollout and
        training, and the trainer must be able to leave the device."""
        if not self.placement.time_sharing:
            return
        if self.placement.layout != "colocated":
            raise ValueError("placement.time_sharing makes the trainer and engines take turns on the same GPUs: set "
                             "placement.layout=colocated (or placement.time_sharing=false)")
        if self.rollout.loop.kind != "sync":
            raise ValueError(f"placement.time_sharing cannot run rollout.loop={self.rollout.loop.kind}: it overlaps "
                             "generation with training, which is impossible while they share a GPU by turns; set "
                             "rollout.loop=sync, or placement.time_sharing=false with GPUs of their own")
        if self.training.backend != "fsdp2":
            raise ValueError("placement.time_sharing offloads the trainer between updates, which only the fsdp2 "
                             "backend implements: set training.backend=fsdp2 or placement.time_sharing=false")

    def _teacher_fits(self) -> None:
        source = self.algorithm.teacher_source
        if source == "warmup" and self.warmup.sft_steps == 0:
            raise ValueError("algorithm.teacher_source=warmup distils the SFT warm-up's result, but warmup.sft_steps=0: "
                             "set warmup.sft_steps > 0 or teacher_source to a model source")
        if source not in (None, "warmup"):
            try:
                ModelConfig(source=source)
            except ValidationError as exc:
                raise ValueError(f"algorithm.teacher_source: {exc.errors()[0]['msg']}") from None

    def _routing_replay_fits(self) -> None:
        if not self.training.megatron.routing_replay:
            return
        if self.training.backend != "megatron":
            raise ValueError("training.megatron.routing_replay replays experts in the Megatron trainer only: set "
                             "training.backend=megatron or training.megatron.routing_replay=false")
        if self.model.source.startswith("builtin:"):
            raise ValueError(f"training.megatron.routing_replay needs an MoE model, but {self.model.source} is dense: "
                             "set training.megatron.routing_replay=false (or model.source to a Qwen3-MoE model)")
        if self.rollout.generate:
            raise ValueError("training.megatron.routing_replay replays the experts of single-call samples; a custom "
                             "rollout.generate builds samples turn by turn: unset one of them")
        if self.rollout.engine.kind == "sglang" and not self.rollout.engine.server_args.get("enable_return_routed_experts"):
            raise ValueError("training.megatron.routing_replay needs the routed experts from SGLang: set "
                             "rollout.engine.server_args.enable_return_routed_experts=true")

    @property
    def routing_replay(self) -> bool:
        """Whether engines are asked for routed experts and the trainer replays them."""
        return self.training.megatron.routing_replay  # _routing_replay_fits: only with megatron

    def digest(self) -> str:
        """Stable hash of the resolved config (recorded in manifests and MLflow tags)."""
        blob = json.dumps(self.model_dump(mode="json"), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]
