"""The `miles` command line: run, plan and inspect RL post-training recipes."""

from __future__ import annotations

import json
import os
import secrets
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import typer
import yaml
from rich.console import Console
from rich.table import Table

from infra.stack import RAY_LOOPBACK_ONLY
from miles_core.config import ConfigError, RunConfig, field_docs, load_config
from miles_core.config.transport import choose_transport
from miles_core.driver.placement import describe, strategy
from tasks.retry import termination_signal_in

if TYPE_CHECKING:
    from miles_core.summary import RunSummary

app = typer.Typer(help="RL post-training as durable Prefect flows.", no_args_is_help=True,
                  context_settings={"help_option_names": ["-h", "--help"]})
console = Console()


def _register_stack() -> None:
    from infra.k8s import k8s_app
    from infra.stack_cli import stack_app

    app.add_typer(stack_app, name="stack", help="Local service stack: Prefect server + worker, MLflow, S3, Ray head.")
    app.add_typer(k8s_app, name="k8s", help="Render Kubernetes manifests (Prefect work pool, KubeRay RayJob).")


_register_stack()


# Read by huggingface_hub and transformers once, at import: set before the recipe's input checks
# load a tokenizer, or a log file gets progress bars and library warnings.
LIBRARY_DEFAULTS = {"HF_HUB_DISABLE_PROGRESS_BARS": "1", "TRANSFORMERS_VERBOSITY": "error",
                    "TOKENIZERS_PARALLELISM": "false"}


def quiet_libraries() -> None:
    """LIBRARY_DEFAULTS, where the environment does not set them already."""
    for key, value in LIBRARY_DEFAULTS.items():
        os.environ.setdefault(key, value)


def local_environment(work_dir: str, ray_address: str | None = None) -> None:
    """Defaults for the embedded stack; anything already set in the environment wins.

    A local Ray cluster binds loopback only and takes token auth with a token drawn for this
    process (inherited by the raylet and workers, never written or logged). Ray reads both once,
    at import, so this must run before anything imports Ray.
    """
    root = Path(work_dir).resolve()
    (root / "prefect").mkdir(parents=True, exist_ok=True)
    defaults = {
        "PREFECT_HOME": str(root / "prefect"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
        "PREFECT_LOGGING_LEVEL": "INFO",
        "PREFECT_LOGGING_EXTRA_LOGGERS": "miles_core",  # the driver's checkpoint/upload lines
        "PREFECT_RESULTS_PERSIST_BY_DEFAULT": "false",
        "RAY_AUTH_MODE": "disabled" if ray_address or os.environ.get("RAY_ADDRESS") else "token",
        "RAY_USAGE_STATS_ENABLED": "0",
        "MLFLOW_ALLOW_FILE_STORE": "true",
    }
    quiet_libraries()
    for key, value in defaults.items():
        os.environ.setdefault(key, value)
    if os.environ["RAY_AUTH_MODE"] == "token":
        os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))
    if not (ray_address or os.environ.get("RAY_ADDRESS")):
        os.environ.setdefault(*RAY_LOOPBACK_ONLY)
    if "prefect" in sys.modules:  # Prefect reads its settings once, at import
        from prefect.settings import get_current_settings

        home = Path(get_current_settings().home).resolve()
        if home != Path(os.environ["PREFECT_HOME"]).resolve():
            raise RuntimeError(f"Prefect was imported before local_environment({work_dir!r}): it uses {home}, "
                               "not the work dir's prefect/ (import Prefect after calling local_environment)")


def _load(config: Path, overrides: list[str], check_inputs: bool = True) -> RunConfig:
    """The validated recipe, its inputs checked (miles_core.preflight); exit 2 with the reasons."""
    quiet_libraries()
    from miles_core.preflight import preflight

    try:
        cfg = load_config(config, overrides)
        if check_inputs:
            preflight(cfg)
        return cfg
    except ConfigError as exc:
        console.print(f"[red]{exc}[/red]", soft_wrap=True)  # one line per problem, paths unbroken
        raise typer.Exit(2) from None


def layout_rows(cfg: RunConfig) -> list[tuple[str, str]]:
    from miles_core.memory import precision_rows  # as in `plan`: only these rows need it

    gpu = lambda n: f", {n:g} GPU" if n else ""  # noqa: E731
    ray_target = cfg.placement.ray_address or "local Ray (started in-process)"
    return [
        ("ray", ray_target),
        ("trainer", f"{cfg.training.world_size} x {cfg.training.backend} rank actor(s), in all "
                    f"{cfg.training.cpus_per_trainer:g} CPU{gpu(cfg.training.gpus_per_trainer)}"),
        ("rollout", f"{cfg.rollout.num_engines} x {cfg.rollout.engine.kind} engine: {cfg.rollout.cpus_per_engine:g} CPU"
                    f"{gpu(cfg.rollout.gpus_per_engine)} each"),
        ("batch", f"{cfg.rollout.num_prompts_per_step} prompts x {cfg.rollout.num_samples_per_prompt} samples, "
                  f"<= {cfg.rollout.max_new_tokens} new tokens"),
        ("steps", f"{_warmup_steps(cfg)} SFT warm-up, {cfg.training.num_steps} {cfg.algorithm.name} steps, "
                  f"checkpoint every {cfg.checkpoint.interval_steps}"),
        ("loop", f"{cfg.rollout.loop.kind}, weights by {transport_text(cfg)}"),
        ("placement", f"{cfg.placement.layout}: {strategy(cfg)} placement group"),
        *describe(cfg),
        *precision_rows(cfg),
    ]


def transport_text(cfg: RunConfig) -> str:
    """The transport and why: what `auto` chooses for this placement, or that the recipe chose another."""
    kind, (best, reason) = cfg.rollout.weight_transport.kind, choose_transport(cfg)
    return f"{kind} ({reason})" if kind == best else f"{kind} (set by the recipe; auto would choose {best}: {reason})"


def _warmup_steps(cfg) -> str:
    w = cfg.warmup
    if w.target_pass_at_1 is None or w.sft_steps == 0:
        return str(w.sft_steps)
    return f"<= {w.sft_steps} (until probe pass@1 >= {w.target_pass_at_1:g})"


@app.command()
def plan(config: Path = typer.Argument(..., help="YAML recipe, e.g. configs/local.yaml"),
         set_: list[str] = typer.Option([], "--set", help="dotted.key=value override (repeatable)"),
         fields: bool = typer.Option(False, "--fields", help="print every config field with its docs"),
         skip_preflight: bool = typer.Option(False, "--skip-preflight",
                                             help="validate the recipe only, not its model, data and store (e.g. "
                                                  "sources that only the cluster reaches)"),
         gpu_gib: float = typer.Option(80.0, "--gpu-gib", help="memory of one GPU in GiB, against which a "
                                                               "time-shared layout's phase peaks are checked")) -> None:
    """Validate a recipe and its inputs, print the resolved config, resource layout and stages
    (runs nothing, writes nothing)."""
    cfg = _load(config, set_, check_inputs=not skip_preflight)
    if fields:
        table = Table("field", "default", "meaning", show_lines=False)
        for name, default, doc in field_docs():
            table.add_row(name, default, doc)
        console.print(table)
        return
    console.rule(f"resolved config ({config}, digest {cfg.digest()})")
    console.print(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    layout = Table("resource", "layout", title="placement")
    for row in layout_rows(cfg):
        layout.add_row(*row)
    console.print(layout)
    from miles_core.memory import check_phases_fit, describe_estimate, describe_phases  # only `plan` needs them

    memory = Table("what", "estimate", title="trainer memory per GPU (see miles_core/memory.py for what it counts)")
    for row in describe_estimate(cfg):
        memory.add_row(*row)
    console.print(memory)
    if phases := describe_phases(cfg):
        table = Table("phase", "peak", title="trainer and engines on one GPU, per phase of a step")
        for row in phases:
            table.add_row(*row)
        console.print(table)
    try:
        check_phases_fit(cfg, gpu_gib)
    except ValueError as exc:
        console.print(f"[red]{exc}[/red]", soft_wrap=True)
        raise typer.Exit(2) from None
    from miles_core.summary import STAGES

    console.print("stages: " + " -> ".join(STAGES))


@app.command()
def run(config: Path = typer.Argument(..., help="YAML recipe, e.g. configs/local.yaml"),
        set_: list[str] = typer.Option([], "--set", help="dotted.key=value override (repeatable)"),
        run_dir: Path | None = typer.Option(None, "--run-dir", help="local run directory (default <work_dir>/runs/<run_key>)"),
        resume: str | None = typer.Option(None, "--resume", help="run key to resume from its latest checkpoint")) -> None:
    """Run the rl-posttrain flow in this process (ephemeral Prefect, local Ray unless configured)."""
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    _refuse_secret_overrides(set_)
    cfg = _load(config, set_)
    local_environment(cfg.storage.work_dir, cfg.placement.ray_address)
    _check_run_target(cfg, run_dir, resume)
    from flows.rl_posttrain import rl_posttrain  # imports Prefect/Ray only when running

    try:
        summary = rl_posttrain(config_path=str(config), overrides=list(set_), resume_from=resume,
                               run_dir=str(run_dir) if run_dir else None)
    except Exception as exc:  # noqa: BLE001 - the CLI boundary: one clear line, details in the log above
        signum = termination_signal_in(exc)
        if signum is not None:
            _exit_on_sigterm(signum, None)
        console.print(f"[red]run failed: {type(exc).__name__}: {exc}[/red]", soft_wrap=True)
        raise typer.Exit(1) from None
    from miles_core.summary import RunSummary

    print_summary(RunSummary.model_validate(summary))


def _refuse_secret_overrides(overrides: list[str]) -> None:
    """Exit 2 on a --set value that looks like a secret: it becomes a flow parameter, which
    Prefect stores (a deployment's schema refuses the same ones)."""
    from miles_core.tracking.redaction import secret_in_override

    found = [o.split("=", 1)[0] for o in overrides if secret_in_override(o)]
    if found:
        console.print(f"[red]--set {', '.join(found)}: the value looks like it holds a secret (a secret-named key, "
                      "URL credentials, or a token/password in a query string or command), and --set values are "
                      "stored as flow parameters. Secrets come from the environment (HF_TOKEN, AWS_SECRET_ACCESS_KEY, ...; "
                      "an eval command or service reads its own token from there): drop it from --set[/red]", soft_wrap=True)
        raise typer.Exit(2)


def _check_run_target(cfg: RunConfig, run_dir: Path | None, resume: str | None) -> None:
    """Exit 2 with one message when --resume names no run (a malformed key, or one MLflow does
    not know) or the run directory holds another run's files, before Prefect starts (and
    records a flow run). The flow checks again: deployments do not come here."""
    from miles_core.storage.checkpoint import check_run_dir
    from miles_core.tracking import runs as tracking

    try:
        if resume is not None:
            tracking.check_resumable_run(cfg, resume)
        path = run_dir or (cfg.storage.work_path / "runs" / resume if resume else None)
        if path is not None:
            check_run_dir(path.resolve(), resume)  # a new run's key is not drawn yet: None
    except ValueError as exc:
        console.print(f"[red]{exc}[/red]", soft_wrap=True)
        raise typer.Exit(2) from None


def _exit_on_sigterm(signum: int, _frame) -> None:
    """Stop as Ctrl-C does, with exit handlers: they stop the temporary Prefect server and the
    local Ray this process started, which the default action would leave running as orphans.
    Inside a flow Prefect's handler runs first (the run is marked crashed, its hooks run), then
    hands the signal on to this one."""
    console.print(f"[red]run stopped by {signal.Signals(signum).name}[/red]", soft_wrap=True)
    raise SystemExit(128 + signum)


def print_summary(summary: RunSummary) -> None:
    table = Table("what", "where / value", title=f"run {summary.run_key}: {summary.status}")
    table.columns[1].overflow = "fold"
    table.add_row("held-out pass@1", f"{summary.eval.before:.3f} -> {summary.eval.after:.3f}")
    warmup = summary.warmup
    if warmup.probe_pass_at_1 is not None:
        table.add_row("SFT warm-up", f"{warmup.sft_steps} steps, probe pass@1 {warmup.probe_pass_at_1:.3f}")
    table.add_row("RL steps", f"{summary.steps} (resumed from {summary.resumed_from_step})")
    table.add_row("summary", str(Path(summary.run_dir) / "summary.json"))
    table.add_row("checkpoint", summary.checkpoint_uri)
    table.add_row("HF export", summary.hf_export_uri)
    table.add_row("MLflow", f"{summary.mlflow.tracking_uri} (run {summary.mlflow.run_id})")
    promotion = summary.promotion
    alias = "@champion" if promotion.get("promoted") else "@candidate"
    table.add_row("registry", f"models:/{summary.mlflow.model_name}/{summary.model_version} ({alias}; "
                              f"{promotion.get('reason', 'no gate')})")
    table.add_row("stage seconds", json.dumps(summary.timings))
    console.print(table)


@app.command()
def show(run_dir: Path = typer.Argument(..., help="a run directory containing summary.json")) -> None:
    """Print the summary of a finished run."""
    path = run_dir / "summary.json"
    if not path.is_file():
        console.print(f"[red]{path} not found: the run has not finished (or the path is wrong)[/red]")
        raise typer.Exit(1)
    from pydantic import ValidationError

    from miles_core.summary import RunSummary

    try:
        summary = RunSummary.model_validate_json(path.read_bytes())
    except ValidationError as exc:
        console.print(f"[red]{path} is not a complete run summary ({type(exc).__name__}: {exc}); the run may have "
                      "been stopped while writing it: rerun with `miles run ... --resume <run_key>`[/red]")
        raise typer.Exit(1) from None
    print_summary(summary)


def main() -> None:
    app()


if __name__ == "__main__":
    sys.exit(main())
