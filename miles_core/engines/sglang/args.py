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
}
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
