"""The ``globalbatch`` (alias ``gbs``) command line: a thin layer over the library.

Each command parses flags, calls one library function and prints. Heavy imports
(torch, matplotlib, ray) happen inside the command that needs them, so
``globalbatch plan`` starts fast and works without torch.

Errors: any ``ValueError`` (or click usage error) becomes one line on stderr,
``error: <field>: <value>: <what is allowed>``, and exit code 2 — never a traceback.
"""

from __future__ import annotations

import sys
from typing import Optional

import typer

app = typer.Typer(
    name="globalbatch",
    help="Plan, check and measure the global batch size of PyTorch training.",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


class CliError(ValueError):
    """A user error reported as one line with exit code 2."""


def _fail(message: str) -> "typer.Exit":
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(code=2)


# ---------------------------------------------------------------------------
# Commands. Keep each one thin: parse, call the library, print.
# ---------------------------------------------------------------------------

@app.callback()
def _root() -> None:
    """Plan, check and measure the global batch size of PyTorch training."""


# (commands are registered below this line)


@app.command("plan")
def plan_cmd(
    config: Optional[str] = typer.Option(None, "--config", help="YAML/TOML (our schema), DeepSpeed JSON or HF TrainingArguments JSON."),
    global_batch: Optional[int] = typer.Option(None, "--global-batch", help="Sequences per optimizer step, all ranks."),
    micro_batch: Optional[int] = typer.Option(None, "--micro-batch", help="Sequences per forward/backward per rank."),
    grad_accum: Optional[int] = typer.Option(None, "--grad-accum", help="Micro-batches accumulated per optimizer step."),
    dp: Optional[int] = typer.Option(None, "--dp", help="Data-parallel world size. With --config: a new world size; the global batch stays fixed and accum is re-derived."),
    round_down: bool = typer.Option(False, "--round-down", help="When the new --dp does not divide, round the global batch down and say how much is dropped."),
    seq_len: Optional[int] = typer.Option(None, "--seq-len", help="Tokens per sequence (padded)."),
    valid_tokens_per_seq: Optional[float] = typer.Option(None, "--valid-tokens-per-seq", help="Mean non-padding tokens per sequence."),
    padding_fraction: Optional[float] = typer.Option(None, "--padding-fraction", help="Share of token slots that are padding, 0 ≤ x < 1."),
    total_tokens: Optional[str] = typer.Option(None, "--total-tokens", help="Training budget in tokens, e.g. 100B."),
    lr: Optional[float] = typer.Option(None, "--lr", help="Learning rate (tuned at --lr-base-batch if given)."),
    lr_base_batch: Optional[int] = typer.Option(None, "--lr-base-batch", help="Global batch (sequences) at which --lr was tuned."),
    lr_rule: Optional[str] = typer.Option(None, "--lr-rule", help="linear | sqrt | none (default sqrt)."),
    warmup_tokens: Optional[str] = typer.Option(None, "--warmup-tokens", help="Warmup in tokens, e.g. 375M (converted to steps)."),
    warmup_steps: Optional[int] = typer.Option(None, "--warmup-steps", help="Warmup in steps (converted to tokens)."),
    pp_stages: Optional[int] = typer.Option(None, "--pp-stages", help="Pipeline stages p (micro-batches per step m = grad accum)."),
    virtual_stages: Optional[int] = typer.Option(None, "--virtual-stages", help="Interleaved virtual stages v (default 1)."),
    max_bubble: Optional[float] = typer.Option(None, "--max-bubble", help="Bubble target (fraction of compute) for the smallest-global-batch hint."),
    params: Optional[str] = typer.Option(None, "--params", help="Model parameters N, e.g. 7B (all-reduce volume, priors)."),
    grad_bytes_per_param: Optional[int] = typer.Option(None, "--grad-bytes-per-param", help="Bytes per gradient element (4 fp32, 2 bf16; default 4)."),
    sync_every_micro_step: bool = typer.Option(False, "--sync-every-micro-step", help="All-reduce on every micro-step (no no_sync)."),
    compute: Optional[str] = typer.Option(None, "--compute", help="Training FLOPs C for the DeepSeek prior (default 6·N·D)."),
    loss: Optional[float] = typer.Option(None, "--loss", help="Loss in nats/token for the Kaplan B_crit prior."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON with stable snake_case keys."),
) -> None:
    """State the whole batch geometry of a run, check it, and say what follows from it."""
    import json

    from . import plan as P
    from .config import PlanConfig, build_plan, load_config, plan_table

    kwargs: dict = {}
    if config is not None:
        kwargs = load_config(config, dp_world_size=dp)
    flags = {
        "global_batch": global_batch, "micro_batch": micro_batch, "grad_accum_steps": grad_accum,
        "seq_len": seq_len, "valid_tokens_per_seq": valid_tokens_per_seq, "padding_fraction": padding_fraction,
        "total_tokens": None if total_tokens is None else float(P.parse_count(total_tokens, "--total-tokens")),
        "lr": lr, "lr_base_batch": lr_base_batch, "lr_rule": lr_rule,
        "warmup_tokens": None if warmup_tokens is None else float(P.parse_count(warmup_tokens, "--warmup-tokens")),
        "warmup_steps": warmup_steps, "pp_stages": pp_stages, "virtual_stages": virtual_stages,
        "max_bubble": max_bubble,
        "params": None if params is None else float(P.parse_count(params, "--params")),
        "grad_bytes_per_param": grad_bytes_per_param,
        "compute_flops": None if compute is None else float(P.parse_count(compute, "--compute")),
        "loss_nats": loss,
    }
    kwargs.update({k: v for k, v in flags.items() if v is not None})
    if sync_every_micro_step:
        kwargs["no_sync"] = False
    if round_down:
        kwargs["round_down"] = True
    if dp is not None:
        if config is not None and kwargs.get("source") in ("yaml", "toml", "json") and kwargs.get("dp_world_size") not in (None, dp):
            kwargs["new_dp_world_size"] = dp  # a new world size for a fixed global batch
        else:
            kwargs["dp_world_size"] = dp
    if kwargs.get("dp_world_size") is None and sum(kwargs.get(k) is not None for k in ("global_batch", "micro_batch", "grad_accum_steps")) < 3:
        kwargs["dp_world_size"] = 1
    report = build_plan(PlanConfig(**kwargs))
    if as_json:
        typer.echo(json.dumps(report, indent=2, sort_keys=True))
        return
    from rich.console import Console

    console = Console(width=max(Console().width, 120))  # the arithmetic column reads best unwrapped
    console.print(plan_table(report))
    for w in report["warnings"]:
        console.print(f"[yellow]warning:[/yellow] {w}")
    if report["priors"]:
        console.print("[dim]priors are scaling-law predictions, not measurements: measure with `globalbatch sweep`/`noise`.[/dim]")


@app.command("noise")
def noise_cmd(
    task: str = typer.Option("tinygpt", "--task", help="Task: tinygpt, mnist or package.module:function."),
    micro_batch: int = typer.Option(8, "--micro-batch", help="Samples (sequences) per forward/backward per rank."),
    grad_accum: int = typer.Option(4, "--grad-accum", help="Micro-batches per step; on one process ≥ 2 (they are the small batches)."),
    steps: int = typer.Option(50, "--steps", help="Optimizer steps (windows) to train and measure."),
    lr: float = typer.Option(1e-3, "--lr", help="Constant learning rate (B_simple depends on it; it is logged)."),
    optimizer: str = typer.Option("adamw", "--optimizer", help="adamw or sgd."),
    seed: int = typer.Option(0, "--seed", help="Seed of the model init and the data order."),
    log_every: int = typer.Option(5, "--log-every", help="Steps between estimates (rows of the curve)."),
    half_life_windows: float = typer.Option(10.0, "--half-life-windows", help="EMA half-life in windows of the global batch (forgetting is per unit)."),
    adam_variant: bool = typer.Option(False, "--adam-variant", help="Also report the Adam-preconditioned variant g/(√v̂+eps)."),
    out: str = typer.Option("runs/noise", "--out", help="Directory for noise.csv (and tb/ with --tensorboard)."),
    tensorboard: bool = typer.Option(False, "--tensorboard", help="Also write TensorBoard scalars (pip install 'globalbatch[tensorboard]')."),
    device: Optional[str] = typer.Option(None, "--device", help="cpu, cuda or cuda:N (default cuda when available)."),
    task_arg: list[str] = typer.Option([], "--task-arg", help="Task override KEY=VALUE (repeatable), e.g. d_model=64."),
) -> None:
    """Measure the gradient noise scale B_simple (McCandlish et al. 2018) over a short training run."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    from .noise import NoiseRunConfig, format_estimate, measure_noise
    from .sweep import parse_task_args

    cfg = NoiseRunConfig(task=task, task_overrides=parse_task_args(task_arg), micro_batch=micro_batch,
                         grad_accum_steps=grad_accum, steps=steps, lr=lr, optimizer=optimizer, seed=seed,
                         log_every=log_every, half_life_windows=half_life_windows, adam_variant=adam_variant,
                         device=device)
    console = Console(width=max(Console().width, 110))
    console.print(f"noise: {task}, {micro_batch} samples × {grad_accum} accum per rank, {steps} steps, lr {lr:g} "
                  f"({optimizer}); EMA half-life {half_life_windows:g} windows")

    def show(row: dict) -> None:
        keys = [k[len("b_simple_"):] for k in row if k.startswith("b_simple_")]
        parts = [f"{k}={row['b_simple_' + k]:,.4g} [{row['low_' + k]:,.4g}, {row['high_' + k]:,.4g}]" for k in keys]
        console.print(f"step {row['step']:>5}  loss {row['loss']:.4f}  " + "  ".join(parts), markup=False,
                      highlight=False)

    try:
        result = measure_noise(cfg, out_dir=out, tensorboard=tensorboard, on_row=show)
    except ImportError as exc:
        raise ValueError(f"--tensorboard: {exc}") from exc
    if not result.rows:
        return  # not rank 0
    table = Table(title=f"B_simple curve ({result.unit}-mean loss; interval {next(iter(result.final.values())).confidence:.0%} Fieller)")
    keys = [k[len("b_simple_"):] for k in result.rows[0] if k.startswith("b_simple_")]
    for col in ["step", "loss", "lr", "batch"] + keys:
        table.add_column(col, justify="right")
    for row in result.rows:
        cells = [str(row["step"]), f"{row['loss']:.4f}", f"{row['lr']:.3g}",
                 f"{row['batch_units']:,} {result.unit}s"]
        cells += [f"{row['b_simple_' + k]:,.4g} [{row['low_' + k]:,.4g}–{row['high_' + k]:,.4g}]" for k in keys]
        table.add_row(*[Text(c) for c in cells])  # Text: "[...]" is not rich markup
    console.print(table)
    for key, est in result.final.items():
        source, unit = key.split("/")
        label = {"micro": "micro-batches", "rank": "DP ranks", "micro_adam": "micro-batches, Adam-preconditioned VARIANT",
                 "rank_adam": "DP ranks, Adam-preconditioned VARIANT"}[source]
        console.print(f"B_simple ({label}, per {unit}): {format_estimate(est)}; lr {est.lr:g}, "
                      f"batch {est.big_count:,.0f} {unit}s, {est.windows} windows", markup=False, highlight=False)
    if result.csv_path:
        console.print(f"wrote {result.csv_path}" + (f" and {out}/tb" if tensorboard else ""))


def main(argv: Optional[list[str]] = None) -> None:
    """Console-script entry point with one-line errors and exit code 2."""
    command = typer.main.get_command(app)
    try:
        rv = command.main(args=argv, prog_name="globalbatch", standalone_mode=False)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except typer.Abort:
        typer.echo("error: aborted", err=True)
        sys.exit(130)
    except (ValueError, FileNotFoundError, IsADirectoryError) as exc:
        typer.echo(f"error: {exc}", err=True)
        sys.exit(2)
    except Exception as exc:
        # click's (or typer's vendored click's) usage errors: bad flag, bad value, missing argument.
        if not hasattr(exc, "format_message"):
            raise
        if type(exc).__name__ == "NoArgsIsHelpError" and getattr(exc, "ctx", None) is not None:
            typer.echo(exc.ctx.get_help())
            sys.exit(0)
        typer.echo(f"error: {exc.format_message()}", err=True)
        sys.exit(getattr(exc, "exit_code", 2) or 2)
    sys.exit(rv if isinstance(rv, int) else 0)


if __name__ == "__main__":  # pragma: no cover
    main()
