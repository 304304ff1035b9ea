"""The SGLang server args a recipe may set, checked against SGLang's own source.

Every entry is an exact, non-deprecated option of each version in `SGLANG_VERSIONS_CHECKED`
(tests/contract pins this against a snapshot parsed from those wheels). An arg outside the
table fails config validation: SGLang's parser would either exit at start-up (an unknown
flag) or silently take it as a prefix of another option (argparse abbreviations are on).
"""

from __future__ import annotations

from typing import Any

SGLANG_VERSIONS_CHECKED = ("0.5.16", "0.5.17", "0.5.23")

# name -> True for a boolean flag (`--name`), False for an option taking a value (`--name v`).
SERVER_ARGS: dict[str, bool] = {
    # model and numerics
    "tokenizer_path": False, "dtype": False, "kv_cache_dtype": False, "quantization": False,
    "load_format": False, "trust_remote_code": True, "context_length": False,
    "served_model_name": False, "random_seed": False, "enable_deterministic_inference": True,
    # parallelism and multi-node engines
    "tp_size": False, "dp_size": False, "pp_size": False, "ep_size": False, "moe_a2a_backend": False,
    "moe_runner_backend": False, "dist_init_addr": False, "nnodes": False, "node_rank": False,
    "nccl_port": False, "base_gpu_id": False,
    # memory and scheduling
    "mem_fraction_static": False, "enable_memory_saver": True, "chunked_prefill_size": False,
    "max_running_requests": False, "max_total_tokens": False, "page_size": False,
    "schedule_policy": False, "disable_radix_cache": True,
    # kernels and graphs
    "attention_backend": False, "sampling_backend": False, "grammar_backend": False, "cuda_graph_max_bs_decode": False,
    "enable_torch_compile": True, "torch_compile_max_bs": False,
    # RL and operations
    "enable_return_routed_experts": True, "weight_version": False, "skip_server_warmup": True,
    "enable_metrics": True, "log_level": False, "watchdog_timeout": False,
    # LoRA adapters served beside the base (training.lora: lora_server_args below)
    "enable_lora": True, "max_lora_rank": False, "lora_target_modules": False, "max_loras_per_batch": False,
    "max_loaded_loras": False, "lora_paths": False,
}
# Options taking several values (`nargs="*"` in SGLang's parser): `--name v1 v2`.
LIST_ARGS = frozenset({"lora_target_modules", "lora_paths"})
# Set by the launcher itself (address, the model it was given, the API key from the environment).
LAUNCHER_ARGS = ("model_path", "host", "port", "api_key")
# "0.5.16, 0.5.17 and 0.5.23", for error messages.
_VERSIONS_TEXT = ", ".join(SGLANG_VERSIONS_CHECKED[:-1]) + " and " + SGLANG_VERSIONS_CHECKED[-1]


def check_server_args(server_args: dict[str, Any]) -> dict[str, Any]:
    """The args with `-` spelled `_`; ValueError naming the first arg SGLang would not take."""
    normalized = {key.replace("-", "_"): value for key, value in server_args.items()}
    for key, value in normalized.items():
        if key in LAUNCHER_ARGS:
            raise ValueError(f"SGLang server arg {key!r} is set by the launcher: remove it from "
                             "rollout.engine.server_args")
        if key not in SERVER_ARGS:
            raise ValueError(f"unknown SGLang server arg {key!r} (--{key.replace('_', '-')}): not an exact, "
                             f"non-deprecated option of sglang {_VERSIONS_TEXT}; "
                             f"allowed: {', '.join(sorted(SERVER_ARGS))}")
        if SERVER_ARGS[key] and not isinstance(value, bool):
            raise ValueError(f"SGLang server arg {key!r} is a flag: set it to true or false, not {value!r}")
        if isinstance(value, (list, tuple)) and key not in LIST_ARGS:
            raise ValueError(f"SGLang server arg {key!r} takes one value, not the list {value!r}")
    return normalized


def server_arg_flags(server_args: dict[str, Any]) -> list[str]:
    """{"mem_fraction_static": 0.7, "skip_server_warmup": True} -> CLI flags (False flags and
    None values are left out)."""
    flags: list[str] = []
    for key, value in check_server_args(server_args).items():
        if value is None or value is False:
            continue
        flags.append("--" + key.replace("_", "-"))
        if not SERVER_ARGS[key]:
            flags.extend(str(v) for v in (value if isinstance(value, (list, tuple)) else [value]))
    return flags


# ---- LoRA serving (training.lora with SGLang engines) -------------------------------------------
# SGLang's LORA_TARGET_ALL_MODULES: every module its LoRA pool supports in the model, lm_head and
# embed_tokens included (lora/utils.py auto_detect_lora_target_modules).
SGLANG_ALL_MODULES = "all"
# How SGLang's LoRA pool names what an adapter targets (lora/utils.py get_normalized_target_modules):
# q/k/v share one fused projection, as gate/up do, so naming one of them admits adapters on the others.
_FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
          "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}


def lora_pool_modules(modules: list[str]) -> set[str]:
    """Module names as SGLang's LoRA memory pool groups them ({"all"} for "all")."""
    return {SGLANG_ALL_MODULES} if SGLANG_ALL_MODULES in modules else {_FUSED.get(m, m) for m in modules}


def lora_server_args(server_args: dict[str, Any], rank: int, modules: list[str]) -> dict[str, Any]:
    """server_args plus what serving adapters of `rank` on `modules` (training.lora.rank and
    .modules, "all-linear" resolved to its names) needs: enable_lora, max_lora_rank and
    lora_target_modules (SGLang must be given both when no --lora-paths are preloaded). Values the
    recipe sets are kept if they admit such adapters; ValueError saying how to fix them otherwise."""
    out = dict(server_args)
    where = "rollout.engine.server_args"
    if out.get("enable_lora") is False:
        raise ValueError(f"training.lora serves adapters on SGLang: remove {where}.enable_lora=false")
    out["enable_lora"] = True
    if out.get("max_lora_rank") is None:
        out["max_lora_rank"] = rank
    elif int(out["max_lora_rank"]) < rank:
        raise ValueError(f"{where}.max_lora_rank={out['max_lora_rank']} is below training.lora.rank={rank}: SGLang "
                         f"would refuse every adapter; set it to {rank} or more, or remove it")
    targets = out.get("lora_target_modules")
    if targets is None:
        out["lora_target_modules"] = sorted(modules)
    else:
        targets = [targets] if isinstance(targets, str) else list(targets)
        if SGLANG_ALL_MODULES in targets and len(targets) > 1:
            raise ValueError(f"{where}.lora_target_modules: SGLang takes '{SGLANG_ALL_MODULES}' only alone, got {targets}")
        missing = lora_pool_modules(modules) - lora_pool_modules(targets) - {SGLANG_ALL_MODULES}
        if SGLANG_ALL_MODULES not in targets and missing:
            raise ValueError(f"{where}.lora_target_modules={targets} leaves out {sorted(missing)}, which "
                             f"training.lora adapts: add them, use [{SGLANG_ALL_MODULES}], or remove the arg")
        out["lora_target_modules"] = targets
    _check_lora_slots(out, where)
    return out


def _check_lora_slots(args: dict[str, Any], where: str) -> None:
    """A sync loads the new version's adapter before it unloads the previous one: two at once."""
    per_batch = int(args.get("max_loras_per_batch") or 8)  # SGLang's default
    loaded = args.get("max_loaded_loras")
    if per_batch < 1:
        raise ValueError(f"{where}.max_loras_per_batch must be at least 1, got {per_batch}")
    if loaded is not None and int(loaded) < max(2, per_batch):
        raise ValueError(f"{where}.max_loaded_loras={loaded}: a weight sync holds two adapters (the new version "
                         f"loads before the old unloads) and SGLang needs at least max_loras_per_batch ({per_batch}); "
                         f"set it to {max(2, per_batch)} or more, or remove it")
