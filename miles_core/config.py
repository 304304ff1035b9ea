"""Run configuration: one pydantic schema for every recipe, YAML + dotted overrides.

Every field carries a docstring (shown by `miles plan` and in validation errors). Unknown
fields are rejected so that a typo never silently falls back to a default.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class ConfigError(ValueError):
    """A recipe that cannot run; the message names each bad field and how to fix it."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)


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
    seed: int = 0
    """Seed of the random initialisation, part of the built-in model's identity."""

    @model_validator(mode="after")
    def _heads_divide(self) -> "TinyModelConfig":
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

    @model_validator(mode="after")
    def _known_scheme(self) -> "ModelConfig":
        src = self.source
        if src.startswith("builtin:") and src != "builtin:tiny-qwen3":
            raise ValueError(f"unknown built-in model {src!r}; the only one is 'builtin:tiny-qwen3'")
        if src.startswith("hf://") and "/" not in src[len("hf://"):]:
            raise ValueError("hf:// sources look like 'hf://org/repo' or 'hf://org/repo@revision'")
        return self


class ArithmeticTaskConfig(Section):
    num_train: int = Field(4000, ge=1)
    """Training problems generated for the built-in addition task."""
    num_eval: int = Field(200, ge=1)
    """Held-out problems (disjoint from training) for evaluation."""
    max_operand: int = Field(99, ge=1)
    """Operands are drawn from [0, max_operand]."""
    seed: int = 1234
    """Seed of the problem generator, part of the dataset's identity."""


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
    apply_chat_template: bool = True
    """Render chat-message prompts with the tokenizer's chat template."""
    max_prompt_tokens: int = Field(1024, ge=1)
    """Prompts longer than this are skipped when the dataset is read (and counted)."""


class WarmupConfig(Section):
    sft_steps: int = Field(60, ge=0)
    """Supervised steps on the training labels before RL; 0 skips the warm-up. Kept short
    so the policy has room to improve with RL."""
    batch_size: int = Field(64, ge=1)
    """Examples per warm-up step."""
    lr: float = Field(3e-3, gt=0)
    """Learning rate of the warm-up."""


class RolloutConfig(Section):
    engine: Literal["embedded", "sglang"] = "embedded"
    """Rollout engine: `embedded` (transformers, runs anywhere) or `sglang` (GPU clusters)."""
    num_engines: int = Field(1, ge=1)
    """Engine replicas; each is a Ray actor."""
    num_prompts_per_step: int = Field(32, ge=1)
    """Prompts drawn from the dataset for one RL step."""
    num_samples_per_prompt: int = Field(8, ge=1)
    """Group size n: responses sampled per prompt (GRPO needs n >= 2)."""
    max_new_tokens: int = Field(8, ge=1)
    """Generation budget per response."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature; the trainer scales logits by the same value."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling threshold."""
    reward: str = "exact_match"
    """Reward function: a registered name (exact_match, math_boxed, dapo) or `module:function`."""
    weight_transport: Literal["object_store", "broadcast", "disk"] = "object_store"
    """How weights reach the engines after each step: Ray's object store (same node, zero
    copy), a torch.distributed broadcast from the trainer (gloo on CPU, NCCL on GPU, bucketed),
    or an HF safetensors directory on shared disk."""
    broadcast_bucket_megabytes: int = Field(512, ge=1)
    """Bucket size of the broadcast transport (one engine request per bucket)."""
    server_args: dict[str, Any] = {}
    """SGLang server args (e.g. {mem_fraction_static: 0.8}); unknown ones are dropped with a warning."""
    bind_host: Literal["loopback", "node_ip"] = "loopback"
    """Engine HTTP servers bind to 127.0.0.1 (one-machine clusters) or the Ray node's IP."""
    request_timeout_seconds: float = Field(300.0, gt=0)
    """An engine that does not answer a generate request within this is treated as hung."""
    health_timeout_seconds: float = Field(30.0, gt=0)
    """An engine whose /health_generate does not answer within this (checked after every step)
    is killed and restarted."""
    loop: Literal["sync", "one_step_off", "fully_async"] = "sync"
    """Rollout schedule: sync (generate, then train), one_step_off (generate step k+1 while
    step k trains), fully_async (a persistent producer with a bounded buffer)."""
    max_weight_staleness: int = Field(1, ge=0)
    """fully_async: batches generated more than this many weight versions ago are stale."""
    stale_policy: Literal["drop", "retry"] = "drop"
    """fully_async: a stale batch is dropped (the next one is used) or regenerated at once."""
    async_buffer_batches: int = Field(1, ge=1)
    """fully_async: batches the producer may generate ahead of the trainer."""
    verify_weight_sync: bool = False
    """After each sync, compare a sha256 of engine and trainer weights (slow on big models)."""
    cpus_per_engine: float = Field(1.0, gt=0)
    """Ray CPUs reserved per engine actor."""
    gpus_per_engine: float = Field(0.0, ge=0)
    """Ray GPUs reserved per engine actor (0 on CPU machines)."""


class TrainingConfig(Section):
    backend: Literal["fsdp2", "megatron"] = "fsdp2"
    """Training backend: torch FSDP2 or Megatron-LM."""
    num_steps: int = Field(40, ge=1)
    """RL steps (rollout -> train -> weight sync) in the run."""
    lr: float = Field(1e-3, gt=0)
    """Adam learning rate of the RL stage."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    adam_betas: tuple[float, float] = (0.9, 0.99)
    """AdamW betas."""
    grad_clip: float = Field(1.0, gt=0)
    """Max global gradient norm."""
    lr_warmup_steps: int = Field(0, ge=0)
    """Linear learning-rate warm-up steps (then constant)."""
    micro_batch_size: int = Field(256, ge=1)
    """Sequences per forward/backward; gradients accumulate across micro-batches."""
    num_updates_per_step: int = Field(1, ge=1)
    """Optimizer updates per RL step (mini-batches); >1 makes the ratio differ from 1."""
    num_threads: int = Field(2, ge=1)
    """torch intra-op threads of the trainer and engine processes on CPU."""
    cpus_per_trainer: float = Field(1.0, gt=0)
    """Ray CPUs reserved by the trainer actor."""
    gpus_per_trainer: float = Field(0.0, ge=0)
    """Ray GPUs reserved by the trainer actor."""


class CorrectionConfig(Section):
    kind: Literal["none", "tis", "icepop", "mis"] = "none"
    """Rollout/trainer mismatch correction: truncated IS (tis), IcePop (zero weight outside
    [low, high]), or MIS/rejection sampling (mis, see level/mode). Metrics are always logged."""
    level: Literal["token", "sequence", "geometric"] = "token"
    """MIS ratio level: per token, per sequence (exp of the sum), or geometric (exp of the mean)."""
    mode: Literal["truncate", "clip", "mask"] = "truncate"
    """MIS weight mode: min(w, high), clamp(w, low, high), or w inside [low, high] else 0."""
    low: float = Field(0.0, ge=0)
    """Lower bound of the importance weight."""
    high: float = Field(2.0, gt=0)
    """Upper bound of the importance weight."""
    veto_threshold: float | None = Field(None, gt=0)
    """MIS veto: drop a whole sequence if any token ratio is below this."""


ALGORITHMS = ("grpo", "gspo", "cispo", "ppo", "reinforce_pp", "reinforce_pp_baseline", "opd", "sft")
GROUP_ALGORITHMS = ("grpo", "gspo", "cispo", "reinforce_pp_baseline")
KL_IN_REWARD_ALGORITHMS = ("ppo", "reinforce_pp", "reinforce_pp_baseline")


class AlgorithmConfig(Section):
    name: Literal["grpo", "gspo", "cispo", "ppo", "reinforce_pp", "reinforce_pp_baseline", "opd", "sft"] = "grpo"
    """Objective: grpo, gspo (sequence ratio), cispo, ppo (critic + GAE), reinforce_pp,
    reinforce_pp_baseline, opd (on-policy distillation from algorithm.teacher_source), sft."""
    normalize_std: bool = True
    """Group advantages divided by the group std (False gives Dr.GRPO)."""
    group_normalize: bool = True
    """Subtract the group mean from rewards (False uses raw rewards as advantages)."""
    eps_clip_low: float = Field(0.2, ge=0, lt=1)
    """Lower PPO clip range: ratios below 1 - eps_clip_low are clipped."""
    eps_clip_high: float = Field(0.28, ge=0)
    """Upper PPO clip range (clip-higher): ratios above 1 + eps_clip_high are clipped."""
    dual_clip_c: float | None = Field(None, gt=1)
    """Dual-clip constant c > 1 bounding the loss of negative-advantage tokens; None disables."""
    kl_loss_coef: float = Field(0.0, ge=0)
    """Weight of the KL(actor || reference) loss term (GRPO style)."""
    kl_in_reward_coef: float = Field(0.0, ge=0)
    """beta of the KL penalty folded into token rewards (PPO / REINFORCE++ style)."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator of both KL forms."""
    ref_refresh_interval_steps: int = Field(0, ge=0)
    """Copy the policy into the reference model every this many steps; 0 keeps the initial one."""
    entropy_coef: float = Field(0.0, ge=0)
    """Entropy bonus weight."""
    loss_aggregation: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"] = "token_mean"
    """Reduction of token losses: mean over all tokens of the batch (default), mean of
    per-sequence means, or mean of per-sequence sums over max_new_tokens (Dr.GRPO)."""
    gamma: float = Field(1.0, ge=0, le=1)
    """Discount of PPO/GAE and REINFORCE++ returns."""
    lam: float = Field(1.0, ge=0, le=1)
    """GAE lambda."""
    critic: Literal["auto", "none", "value_head"] = "auto"
    """Critic model: auto (a value head for ppo, none otherwise), none, or value_head."""
    critic_lr: float = Field(1e-3, gt=0)
    """Learning rate of the critic."""
    value_clip: float = Field(0.2, gt=0)
    """Value clipping range around the old values."""
    critic_warmup_steps: int = Field(0, ge=0)
    """First steps that train only the critic (policy frozen)."""
    correction: CorrectionConfig = CorrectionConfig()
    """Importance correction for rollout/trainer mismatch (needed when rollouts are off-policy)."""
    opd_coef: float = Field(0.0, ge=0)
    """On-policy distillation weight: A_t -= opd_coef * (logp_student - logp_teacher); set
    automatically to 1.0 for name=opd when left at 0."""
    teacher_source: str | None = None
    """Teacher model for distillation: a model source like model.source, or `warmup` for the
    SFT warm-up's result (the student then starts from model.source untouched)."""
    old_logprob_source: Literal["trainer", "rollout"] = "trainer"
    """Log-probs the PPO ratio is taken against: recomputed by the trainer before the update,
    or the rollout engine's (the behaviour policy; an off-policy correction for async loops)."""
    dynamic_sampling: bool = False
    """DAPO dynamic sampling: drop groups whose rewards are all equal, over-sample until full."""
    max_sampling_rounds: int = Field(4, ge=1)
    """Rollout rounds per step at most when dynamic sampling keeps too few groups."""

    @property
    def uses_critic(self) -> bool:
        return self.critic == "value_head" or (self.critic == "auto" and self.name == "ppo")

    @property
    def effective_opd_coef(self) -> float:
        return self.opd_coef or (1.0 if self.name == "opd" else 0.0)

    @model_validator(mode="after")
    def _combinations(self) -> "AlgorithmConfig":
        if self.kl_loss_coef > 0 and self.kl_in_reward_coef > 0:
            raise ValueError("KL as a loss and KL in the reward are exclusive: set kl_loss_coef or "
                             "kl_in_reward_coef to 0")
        if self.kl_in_reward_coef > 0 and self.name not in KL_IN_REWARD_ALGORITHMS:
            raise ValueError(f"kl_in_reward_coef applies to {KL_IN_REWARD_ALGORITHMS}; for {self.name} "
                             "use kl_loss_coef")
        if self.name == "ppo" and self.critic == "none":
            raise ValueError("PPO needs a critic: set algorithm.critic=value_head (or auto)")
        if self.name == "gspo" and self.correction.kind in ("tis", "icepop") or (
                self.name == "gspo" and self.correction.kind == "mis" and self.correction.level == "token"):
            raise ValueError("GSPO uses a sequence-level ratio: token-level corrections do not apply; set "
                             "algorithm.correction.kind=mis with level=sequence or geometric")
        if (self.name == "opd" or self.opd_coef > 0) and not self.teacher_source:
            raise ValueError("distillation needs a teacher: set algorithm.teacher_source (a model source or 'warmup')")
        if self.correction.low >= self.correction.high:
            raise ValueError("algorithm.correction.low must be below correction.high")
        return self


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


class CheckpointConfig(Section):
    interval_steps: int = Field(10, ge=1)
    """Save a checkpoint every this many RL steps (and always after the last)."""
    keep_latest: int = Field(2, ge=1)
    """Complete checkpoints kept in the run directory; older ones are pruned."""


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
    def _greedy_is_single(self) -> "EvalDatasetConfig":
        if self.temperature == 0 and self.num_samples_per_prompt != 1:
            raise ValueError("greedy (temperature=0) gives one response per prompt: set num_samples_per_prompt=1 "
                             "or temperature>0")
        return self


class EvalConfig(Section):
    max_new_tokens: int = Field(8, ge=1)
    """Generation budget of evaluation responses."""
    batch_size: int = Field(256, ge=1)
    """Sequences (prompt x sample) per generation batch during evaluation."""
    pass_k: list[int] = [1]
    """k values of pass@k reported for each dataset (only those <= its num_samples_per_prompt)."""
    datasets: list[EvalDatasetConfig] = []
    """Extra held-out datasets evaluated before and after training, besides data.eval_path."""
    interval_steps: int = Field(0, ge=0)
    """Evaluate on the held-out set every this many RL steps during training; 0 disables."""
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


class StorageConfig(Section):
    work_dir: str = ".miles"
    """Local directory for caches, run directories, and the default MLflow/object store."""
    object_store_uri: str | None = None
    """Where checkpoints and exports are uploaded (`s3://bucket/prefix`, `file:///abs`, ...);
    None means `file://<work_dir>/store`."""


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
    def _cross_field(self) -> "RunConfig":
        if self.algorithm.name in GROUP_ALGORITHMS and self.rollout.num_samples_per_prompt < 2:
            raise ValueError(f"{self.algorithm.name} compares samples within a group: set "
                             "rollout.num_samples_per_prompt >= 2")
        if (self.rollout.loop != "sync" and self.algorithm.name != "sft" and self.algorithm.correction.kind == "none"
                and self.algorithm.old_logprob_source == "trainer"):
            raise ValueError(f"rollout.loop={self.rollout.loop} trains on off-policy samples: set "
                             "algorithm.correction.kind=tis (or icepop/mis) or algorithm.old_logprob_source=rollout")
        if self.rollout.engine == "sglang" and self.rollout.weight_transport == "object_store":
            raise ValueError("SGLang engines run in their own process: set rollout.weight_transport=broadcast "
                             "(or disk)")
        if self.rollout.engine == "sglang" and self.rollout.gpus_per_engine == 0:
            raise ValueError("the sglang engine needs a GPU: set rollout.gpus_per_engine >= 1")
        return self

    def digest(self) -> str:
        """Stable hash of the resolved config (recorded in manifests and MLflow tags)."""
        blob = json.dumps(self.model_dump(mode="json"), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


def _set_dotted(tree: dict[str, Any], dotted_key: str, value: Any) -> None:
    node = tree
    *parents, leaf = dotted_key.split(".")
    for part in parents:
        child = node.setdefault(part, {})
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
        parsed.append((key.strip(), yaml.safe_load(raw) if raw.strip() else ""))
    return parsed


def _explain(exc: ValidationError, source: str) -> str:
    lines = [f"invalid config ({source}):"]
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "<root>"
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


def load_config(path: str | Path, overrides: list[str] = ()) -> RunConfig:
    """Read a YAML recipe, apply `--set` overrides, validate."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        tree = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"config {path} is not valid YAML: {exc}") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"config {path} must be a mapping of sections, got {type(tree).__name__}")
    return build_config(tree, overrides, source=str(path))


def field_docs(model: type[BaseModel] = RunConfig, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted name, default, docstring) for every leaf field: the config reference."""
    rows = []
    for name, info in model.model_fields.items():
        dotted = f"{prefix}{name}"
        annotation = info.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            rows.extend(field_docs(annotation, dotted + "."))
        else:
            rows.append((dotted, repr(info.default), " ".join((info.description or "").split())))
    return rows
