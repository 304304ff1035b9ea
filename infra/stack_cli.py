"""`miles stack up|down|status|automations`: the CLI over infra/stack.py."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from infra.stack import (
    ALL_SERVICES,
    DEFAULT_STATE_DIR,
    HEARTBEAT_SECONDS,
    StackError,
    console,
    mask_env,
    read_env_file,
    stack_status,
    start_stack,
    stop_stack,
)


def status_table(state_dir=DEFAULT_STATE_DIR) -> Table:
    table = Table(title=f"stack {state_dir}")
    for col in ("service", "url", "pid", "alive", "log", "note"):
        table.add_column(col, overflow="fold")  # fold, not "…": URLs and paths get copied
    for row in stack_status(state_dir):
        alive = "[green]yes[/]" if row["alive"] else "[red]no[/]"
        table.add_row(row["service"], row["url"], str(row["pid"]), alive, row["log"], row["note"])
    return table


stack_app = typer.Typer(help="Local services: Prefect server+worker, MLflow, S3 (moto), Ray head.",
                        no_args_is_help=True)
StateOpt = typer.Option(DEFAULT_STATE_DIR, "--state-dir", help="Where state, env file and logs go.")


@stack_app.command()
def up(state_dir: Path = StateOpt,
       services: str = typer.Option(",".join(ALL_SERVICES), help="Comma-separated subset."),
       ray_num_cpus: int = typer.Option(0, help="CPUs Ray may schedule on (0: all)."),
       timeout: float = typer.Option(120.0, help="Seconds each service may take to get healthy.")):
    """Start the missing services; those already alive are left as they are."""
    try:
        info = start_stack(state_dir, services, ray_num_cpus=ray_num_cpus or None, timeout=timeout)
    except StackError as e:
        console.print(f"[red]{e}\n[/]Stop what did start with `miles stack down`.")
        raise typer.Exit(1) from None
    Console().print(status_table(state_dir))
    for name, note in info.notes.items():
        console.print(f"[yellow]{name}: {note}")
    console.print(f"source {info.state_dir / 'env'}")


@stack_app.command()
def down(state_dir: Path = StateOpt):
    """Stop the services this stack started (and nothing else)."""
    try:
        stop_stack(state_dir)
    except StackError as e:
        console.print(f"[red]{e}")
        raise typer.Exit(1) from None


@stack_app.command()
def automations(api_url: str = typer.Option(None, envvar="PREFECT_API_URL",
                                            help="Prefect API (default: $PREFECT_API_URL).")):
    """Apply the crashed-run automations (heartbeat loss -> Crashed -> resume_from run) to a server."""
    if not api_url:
        console.print("[red]no Prefect API: pass --api-url or set PREFECT_API_URL")
        raise typer.Exit(1)
    from infra.automations import apply_to_server  # Prefect is imported only by the commands that use it

    apply_to_server(api_url, HEARTBEAT_SECONDS)


@stack_app.command()
def status(state_dir: Path = StateOpt,
           env: bool = typer.Option(False, "--env", help="Also show the env file, secrets masked.")):
    """Show each service's url, pid, health and log."""
    out = Console()
    out.print(status_table(state_dir))
    if env:
        for key, value in sorted(mask_env(read_env_file(Path(state_dir))).items()):
            out.print(f"{key}={value}", markup=False, highlight=False)


if __name__ == "__main__":
    stack_app()
