"""The `rollout` section. The engine, the weight transport and the rollout schedule are each one
of several variants, written as `{kind: <name>, ...}` with only that variant's own fields (or as
the kind alone: `loop: sync`), so a field of another variant cannot be set by mistake."""

from __future__ import annotations

import re
from functools import reduce
from operator import or_
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BeforeValidator, Field, field_validator

from miles_core.config.base import Section
from miles_core.engines.sglang.args import check_server_args


def _kind_alone(value: Any) -> Any:
    """`loop: sync` means `loop: {kind: sync}`."""
    return {"kind": value} if isinstance(value, str) else value


def variants(*models: type[Section]) -> Any:
    """A field that holds one of `models`, chosen by its `kind`."""
    return Annotated[reduce(or_, models), Field(discriminator="kind"), BeforeValidator(_kind_alone)]


class EmbeddedEngineConfig(Section):
    """Transformers generation behind SGLang's HTTP API (runs anywhere; the CPU default)."""

    kind: Literal["embedded"] = "embedded"
    mem_fraction_static: float | None = Field(None, gt=0, lt=1)
    """As SGLang's --mem-fraction-static, on a GPU: the KV cache may take what is free less
    (1 - this) of the GPU's memory, which stays for others, such as a trainer on the same GPU
    (placement.layout=colocated). Lower it when a colocated trainer runs out of memory. None: the
    KV cache takes 40% of the memory free when it is allocated."""
    max_running_requests: int | None = Field(None, ge=1)
    """Sequences decoded at once, as SGLang's --max-running-requests. None: 1024."""
    # The server's client bounds (miles_core.engines.embedded.http_limits.ServerLimits, whose defaults
    # these repeat: that module imports the web stack, which a config must not need).
    max_request_bytes: int = Field(64 << 20, gt=0)
    """Largest request body the engine's server reads, in bytes; a larger one is answered 413.
    Raise it for prompts that are long token-id lists in large batches."""
    max_prompts_per_request: int = Field(16384, gt=0)
    """Most prompts one /generate may carry (a larger batch is refused, 400). Rollouts send up
    to rollout.num_prompts_per_step x num_samples_per_prompt per engine."""
    request_read_timeout_seconds: float = Field(30.0, gt=0)
    """Seconds a client has to send a whole request, head and body, counted from connecting or
    from the previous response; a slower one is disconnected."""


class SGLangEngineConfig(Section):
    """SGLang servers launched by the engine actors (GPU clusters)."""

    kind: Literal["sglang"] = "sglang"
    server_args: dict[str, Any] = {}
    """SGLang server args (e.g. {mem_fraction_static: 0.8}); one outside the table checked against
    SGLang's source (miles_core.engines.sglang.args) is an error. tp_size defaults to
    rollout.gpus_per_engine. Rollout seeds reach SGLang's sampler only with
    enable_deterministic_inference: true (otherwise samples are not reproducible). With
    training.lora, enable_lora, max_lora_rank (the adapter's rank) and lora_target_modules (its
    modules) are filled in; values set here must admit the adapter, or the config is refused."""
    server_module: str = "sglang.launch_server"
    """The module run as `python -m <module>`: SGLang's server. CI runs the launcher path with
    miles_core.engines.embedded.http_server, the embedded engine behind the same flags."""
    python: str | None = None
    """The interpreter that runs the server: a separate environment's python (or a wrapper
    script that sets one up) for sites that keep SGLang's pinned packages apart from this
    project's. None: the engine actor's own interpreter."""

    @field_validator("python")
    @classmethod
    def _python_is_absolute(cls, value: str | None) -> str | None:
        if value is not None and not Path(value).is_absolute():
            raise ValueError(f"rollout.engine.python must be an absolute path (got {value!r}): the engine "
                             "actor runs on another node, where a relative path means something else")
        return value

    @field_validator("server_args")
    @classmethod
    def _known_server_args(cls, value: dict[str, Any]) -> dict[str, Any]:
        return check_server_args(value)

    @property
    def is_sglang(self) -> bool:
        """False when CI stands the embedded server in for SGLang (no GPU needed)."""
        return self.server_module.startswith("sglang.")


class AutoTransportConfig(Section):
    """The fastest transport the placement allows, chosen when the recipe is loaded (`miles plan`
    prints the choice and why): shared_memory (embedded) or cuda_ipc (SGLang) when trainer and
    engines share one GPU, broadcast across GPUs (disk for SGLang engines with dp_size or
    pp_size > 1), Ray's object store without GPUs."""

    kind: Literal["auto"] = "auto"


class ObjectStoreTransportConfig(Section):
    """Weights through Ray's object store (same node, zero copy): embedded engines only."""

    kind: Literal["object_store"] = "object_store"


class SharedMemoryTransportConfig(Section):
    """One weight buffer the trainer and the engines map: CUDA IPC on a GPU they share
    (placement.layout=colocated), /dev/shm on one CPU machine. Embedded engines only."""

    kind: Literal["shared_memory"] = "shared_memory"


class BroadcastTransportConfig(Section):
    """A torch.distributed broadcast from the trainer (gloo on CPU, NCCL on GPU), bucketed."""

    kind: Literal["broadcast"] = "broadcast"
    bucket_megabytes: int = Field(512, ge=1)
    """Bucket size (one engine request per bucket)."""


class CudaIpcTransportConfig(Section):
    """SGLang engines on the trainer's GPU (placement.layout=colocated): per bucket, the trainer
    hands each engine a CUDA IPC handle to its weights (`/update_weights_from_tensor`), so a sync
    is copies on the GPU and nothing crosses a network or a file. SGLang engines only."""

    kind: Literal["cuda_ipc"] = "cuda_ipc"
    bucket_megabytes: int = Field(512, ge=1)
    """Bucket size: the trainer holds one bucket of weights (in the engines' dtype) besides its own
    during a sync, and sends one engine request per bucket."""


class DiskTransportConfig(Section):
    """An HF safetensors directory on a disk trainer and engines share. With training.lora and
    SGLang engines (the one transport they then take): the adapter alone in PEFT's layout, which
    each engine loads by name (/load_lora_adapter as policy-v<version>)."""

    kind: Literal["disk"] = "disk"


class SyncLoopConfig(Section):
    """Generate, then train: always on-policy."""

    kind: Literal["sync"] = "sync"


class OneStepOffLoopConfig(Section):
    """Generate step k+1 while step k trains (samples one version behind)."""

    kind: Literal["one_step_off"] = "one_step_off"


class FullyAsyncLoopConfig(Section):
    """A persistent producer with a bounded buffer."""

    kind: Literal["fully_async"] = "fully_async"
    max_weight_staleness: int = Field(1, ge=0)
    """Batches generated more than this many weight versions ago are stale."""
    stale_policy: Literal["drop", "retry"] = "drop"
    """A stale batch is dropped (the next one is used) or regenerated at once."""
    buffer_batches: int = Field(1, ge=1)
    """Batches the producer may generate ahead of the trainer, plus one waiting for room; in all
    no more than max_weight_staleness (at least 1), since more would be stale when trained."""


class PartialRolloutsConfig(Section):
    """Partial rollouts (rollout.loop=fully_async): at a weight update the engines' running
    requests return what they have (pause_generation mode=abort), and the producer keeps those
    samples and continues them with the new weights (prompt + tokens so far re-prefilled) instead
    of throwing them away. A sample's tokens then come from several weight versions: each token
    keeps its version and its behaviour log-prob, and the off-policy correction
    (algorithm.correction tis or mis, required) weighs each by its own. A group trains once all
    its samples are done."""

    enabled: bool = False
    """Keep partial samples across weight updates (off: a batch is generated with one version)."""
    max_staleness_versions: int = Field(2, ge=0)
    """A partial sample whose oldest token is more than this many versions behind the engines'
    weights is thrown away with its group (counted in rollout/partial_tokens_thrown_away)."""


EngineConfig = variants(EmbeddedEngineConfig, SGLangEngineConfig)
TransportConfig = variants(AutoTransportConfig, ObjectStoreTransportConfig, SharedMemoryTransportConfig,
                           BroadcastTransportConfig, CudaIpcTransportConfig, DiskTransportConfig)
LoopConfig = variants(SyncLoopConfig, OneStepOffLoopConfig, FullyAsyncLoopConfig)


def _plugin_path(value: str) -> str:
    if not re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", value):
        raise ValueError("expected 'package.module:function'")
    return value


def _reward_url(value: str) -> str:
    if not re.fullmatch(r"https?://[^/@\s]+(/\S*)?", value):
        raise ValueError("expected http(s)://host[:port]/path without credentials (a key goes in "
                         "api_key_env)")
    return value


PluginPath = Annotated[str, AfterValidator(_plugin_path)]


class RemoteRewardConfig(Section):
    """A reward model behind HTTP: each rollout batch is POSTed as JSON {"prompts", "responses",
    "labels", "metadata"} (one entry per sample) and must be answered {"rewards": [float, ...]}."""

    url: Annotated[str, AfterValidator(_reward_url)]
    """Endpoint, e.g. http://reward-model:8000/score (credentials go in api_key_env, not the URL)."""
    api_key_env: str | None = None
    """Environment variable holding a key sent as `Authorization: Bearer <key>`; never logged."""
    timeout_seconds: float = Field(60.0, gt=0)
    """Connect and read limit of one request (seconds without a byte); a failed attempt when exceeded."""
    max_attempts: int = Field(3, ge=1)
    """Attempts per request (timeouts, connection errors, 429 and 5xx are retried; other 4xx are not)."""
    backoff_seconds: float = Field(1.0, ge=0)
    """Wait before the second attempt, doubled after each failure."""
    max_batch_size: int = Field(256, ge=1)
    """Samples per request; a bigger batch is split into several requests."""


class RolloutConfig(Section):
    engine: EngineConfig = EmbeddedEngineConfig()
    """Rollout engine: `embedded` (transformers, runs anywhere) or `sglang` (GPU clusters)."""
    num_engines: int = Field(1, ge=1)
    """Engine replicas; each is a Ray actor."""
    num_prompts_per_step: int = Field(32, ge=1)
    """Prompts drawn from the dataset for one RL step."""
    num_samples_per_prompt: int = Field(8, ge=1)
    """Group size n: responses sampled per prompt (GRPO needs n >= 2)."""
    max_new_tokens: int = Field(8, ge=1)
    """Generation budget per response."""
    ignore_eos: bool = False
    """Generate every response to its full budget, past EOS (SGLang's ignore_eos): with per-prompt
    budgets (data.max_new_tokens_key) this scripts response lengths, as the long-tail bench does
    with a tiny model whose answers are all short. The reward then sees the text after EOS too."""
    precision: Literal["bf16", "fp8"] = "bf16"
    """Weights the engines generate with: `bf16` (the trainer's weights as they are) or `fp8`
    (each decoder layer's linear projections sent as float8_e4m3fn with one scale per 128x128
    block, embeddings, norms and lm_head in bf16: about half the engine's weight memory and
    faster decoding on Hopper GPUs). FP8 samples come from a slightly different policy than the
    trainer's, so fp8 needs algorithm.correction (tis/icepop/mis) or old_logprob_source=rollout,
    and SGLang engines must run with server_args.quantization=fp8. Embedded engines quantize the
    weights they are sent (object_store or shared_memory transport; dequantized matmuls: FP8's
    numerics, not yet its speed)."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature; the trainer scales logits by the same value."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling threshold."""
    reward: str = "exact_match"
    """Reward function: a registered name (exact_match, math, math_boxed, dapo) or `module:function`
    taking (response_text, label) and returning a float."""
    remote_reward: RemoteRewardConfig | None = None
    """Score every batch with a reward model over HTTP instead of `reward`."""
    generate: PluginPath | None = None
    """Custom generation, `module:function` taking (ctx, prompt, sampling_params) and returning the
    prompt's group: a list of num_samples_per_prompt Samples (multi-turn, tool calls, fan-out; see
    the README). None: one engine call per sample."""
    sample_filter: PluginPath | None = None
    """`module:function` taking a scored Sample, False to drop it: a dropped sample keeps its place in
    its group (group statistics stay intact) and trains on no token."""
    group_filter: PluginPath | None = None
    """`module:function` taking a group's scored Samples, False to drop the group before training."""
    weight_transport: TransportConfig = AutoTransportConfig()
    """How weights reach the engines after each step: `auto` (chosen from the placement),
    `object_store` (Ray's, same node), `shared_memory` (one buffer mapped by trainer and engines:
    same GPU or same machine), `cuda_ipc` (SGLang on the trainer's GPU), `broadcast`
    (torch.distributed from the trainer) or `disk` (a shared HF directory)."""
    verify_weight_sync: bool = False
    """After each sync, compare a sha256 of engine and trainer weights (slow on big models)."""
    loop: LoopConfig = SyncLoopConfig()
    """Rollout schedule: `sync` (generate, then train), `one_step_off` (generate step k+1 while
    step k trains), `fully_async` (a persistent producer with a bounded buffer)."""
    partial: PartialRolloutsConfig = PartialRolloutsConfig()
    """Partial rollouts: samples cut by a weight update are continued, not dropped (fully_async)."""
    bind_host: Literal["loopback", "node_ip"] = "loopback"
    """Engine HTTP servers bind to 127.0.0.1 (one-machine clusters) or the Ray node's IP."""
    request_timeout_seconds: float = Field(300.0, gt=0)
    """An engine that does not answer a generate request within this is treated as hung."""
    health_timeout_seconds: float = Field(30.0, gt=0)
    """An engine whose /health_generate does not answer within this (checked after every step)
    is killed and restarted."""
    cpus_per_engine: float = Field(1.0, gt=0)
    """Ray CPUs reserved per engine actor."""
    gpus_per_engine: float = Field(0.0, ge=0)
    """Ray GPUs reserved per engine actor (0 on CPU machines)."""
