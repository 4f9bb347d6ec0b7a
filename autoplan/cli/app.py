"""The command line: `autoplan plan TARGET --budget 24GB`, `autoplan verify ...`, `autoplan devices`.

With `cli.exits`, the only code that prints or exits. Errors are one line on stderr with an exit
code (the table in docs/command-line.md and `ExitCode`); `--debug` adds the traceback. A plan that does not fit is not an
error: the report and the advice are printed and the exit code says "does not fit".
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer
from rich.console import Console
from rich.table import Table

import autoplan
from autoplan.cli.exits import CliError, ExitCode, exit_code_for, print_report, prints_to_stderr, quiet, reported, write_stdout
from autoplan.cli.flags import (ACCUMULATION_STEPS, COMPILE, DROP_OUTPUTS, FUSE_LOSS, HOST_BUDGET, LADDER, MOE_CAPACITY, OFFLOAD,
                                  OPTIMIZER_IMPL, TARGET, UNITS, VERBOSE, Optimizer, OptimizerImpl, OptionsGivenOnce, Precision)
from autoplan.cli.progress import PlanningProgress, progress_wanted
from autoplan.inputs.budget import check_size_syntax, make_budget
from autoplan.inputs.devices import get_device, list_devices
from autoplan.inputs.loop import TrainingLoop
from autoplan.inputs.options import check_time_limit, check_world_size
from autoplan.report.plot import FORMATS, require_pyplot

# Everything that imports torch (seconds) is imported inside the commands, after the options are
# checked: `--help` and a mistyped option are answered at once (tests/test_cli.py checks that
# torch stays unimported).
if TYPE_CHECKING:
    from autoplan.inputs.targets import LoadedTarget
    from autoplan.profile.profiler import Profile

JSON_SCHEMA = "autoplan.plan/3"  # 2: FSDP estimates name communication_buffers, not unsharded_gradients; 3: fused_loss a bool, its logits in fused_loss_logits; bump when a key of the --json document changes meaning or goes away

app = typer.Typer(
    help="Make a PyTorch training step fit a memory budget: plan checkpointing and precision per block, "
    "and say what to change when it does not fit.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


def _world_size(text: Optional[str]) -> int | str | None:
    """--world-size N or auto: the plan's FSDP world size (None: one GPU, no FSDP)."""
    if text is None or text == "auto":
        return text
    if not (text.isascii() and text.isdigit()) or int(text) < 1:
        raise CliError(ExitCode.USAGE, f"--world-size must be a whole number of GPUs, at least 1, or auto; got {text!r}")
    return check_world_size(int(text), option="--world-size")  # OptionError: exit 2, before torch is imported


def _check_options(budget: str, device: Optional[str], reserve: Optional[str], world_size: Optional[str], plot: Optional[Path],
                   time_limit: float = 10.0, allow_over_device: bool = False, moe_capacity: Optional[float] = None,
                   ladder: bool = False, json_path: Optional[Path] = None):
    """Every option's value, before minutes of planning; those that need no torch before seconds of its imports."""
    check_size_syntax(budget, reserve)  # BudgetError: exit 2
    _check_outputs(json=json_path, plot=plot)
    _world_size(world_size)
    check_time_limit(time_limit)  # OptionError: exit 2
    if plot is not None and plot.suffix.lower() not in FORMATS:
        raise CliError(ExitCode.USAGE, f"--plot file must end in {', '.join(FORMATS)}; got {plot.name!r}")
    make_budget(budget, get_device(device), reserve, allow_over_device=allow_over_device)  # DeviceError: exit 2 (this GPU: torch)
    from autoplan.instruments.routing import check_moe_capacity
    from autoplan.inputs.qlora_twin import check_qlora_installed

    check_moe_capacity(moe_capacity)  # OptionError: exit 2
    if ladder:
        check_qlora_installed("--ladder")  # MissingExtraError, exit 7
    if plot is not None:
        require_pyplot()  # PlotUnavailable is exit 7


def _check_outputs(**paths: Optional[Path]) -> None:
    """--json and --plot name files in folders that exist: a typo in a folder is said now, not after minutes of
    planning, and no folder is made that the person did not ask for."""
    for option, path in paths.items():
        if path is None or _is_stdout(path):
            continue
        folder = path.parent
        if not folder.is_dir():
            what = "is not a folder" if folder.exists() else "does not exist"
            raise CliError(ExitCode.USAGE, f"--{option} {path}: the folder {folder} {what}; create it first or write elsewhere")
        if path.is_dir():
            raise CliError(ExitCode.USAGE, f"--{option} {path} is a folder; give a file name in it")


def _loop(drop_outputs: bool, accumulation_steps: int, optimizer_impl: OptimizerImpl) -> TrainingLoop:
    """The training loop the options describe (docs/loops.md): what the plan is for and verify runs."""
    return TrainingLoop(
        keep_outputs=not drop_outputs, accumulation_steps=accumulation_steps, optimizer_impl=optimizer_impl.value
    )


def _plan_options(device, optimizer: Optimizer, precision: Precision, units, reserve, loop, world_size=None) -> dict:
    """autoplan.plan's keyword arguments from the command's options."""
    options = dict(device=device, optimizer=optimizer.value, precision=precision.value, units=_units(units), reserve=reserve, loop=loop)
    if world_size is not None:
        options["world_size"] = _world_size(world_size)
    return options


def _units(values: Optional[list[str]]) -> Optional[list[str]]:
    if not values:
        return None
    return [pattern.strip() for value in values for pattern in value.split(",") if pattern.strip()]


def _plan(target: LoadedTarget, budget: str, options: dict, progress, inputs=None, model=None):
    from autoplan.api import plan as plan_model

    profiles: list[Profile] = []
    try:
        plan = plan_model(model or target.model, budget, example_inputs=inputs if inputs is not None else target.example_inputs,
                             progress=progress, on_profile=profiles.append, **options)
    except Exception as error:
        if exit_code_for(error) != ExitCode.ERROR:
            raise  # autoplan's own errors: mapped by class
        # anything else the target's model raised while planning: what it was, not a bug of autoplan
        raise CliError(ExitCode.CANNOT_PLAN, f"cannot plan {type(target.model).__name__}: {type(error).__name__}: {error}") from error
    return plan, profiles[0]


def _is_stdout(path: Optional[Path]) -> bool:
    """`--json -`: the document goes to stdout, and everything for people to stderr."""
    return path is not None and str(path) == "-"


def _write(path: Path, text: str, err: Console) -> None:
    """Write `text` to `path` (stdout for `-`) and say so on stderr."""
    if _is_stdout(path):
        write_stdout(text)
        return
    try:
        path.write_text(text)
    except OSError as error:
        raise CliError(ExitCode.OUTPUT_FAILED, f"cannot write {path}: {error.strerror or error}") from error
    err.print(f"wrote {path}", markup=False)


def json_document(target: LoadedTarget, plan, advice, budget: str) -> dict:
    """What --json writes: the schema the README documents."""
    return {
        "schema": JSON_SCHEMA,
        "autoplan_version": autoplan.__version__,
        "target": target.spec,
        "budget": budget,
        "inputs": {"batch_size": target.batch_size, "seq_len": target.seq_len, "parameter_count": target.parameter_count},
        "plan": plan.to_dict(),
        "advice": advice.to_dict(),
    }


@app.command("plan", cls=OptionsGivenOnce)
def plan_command(
    target: str = TARGET,
    budget: str = typer.Option(..., "--budget", "-b", help='Memory for the training step: "24GB", "24 GiB", "80%" of the device.'),
    device: Optional[str] = typer.Option(None, "--device", "-d", help="Device profile to plan for (see `autoplan devices`). "
                                         "Default: this machine's GPU, else the cpu profile."),
    batch_size: Optional[int] = typer.Option(None, "--batch-size", min=1, help="Batch size, passed to the factory "
                                             f"(hf: default {1})."),
    seq_len: Optional[int] = typer.Option(None, "--seq-len", min=1, help="Sequence length, passed to the factory (hf: default 1024, "
                                          "capped at the model's maximum)."),
    optimizer: Optimizer = typer.Option(Optimizer.adamw, "--optimizer", help="Optimizer whose state is counted; the 8-bit and paged ones are bitsandbytes' (pip install -e \".[qlora]\")."),
    drop_outputs: bool = DROP_OUTPUTS,
    accumulation_steps: int = ACCUMULATION_STEPS,
    optimizer_impl: OptimizerImpl = OPTIMIZER_IMPL,
    precision: Precision = typer.Option(Precision.auto, "--precision", help="auto: per unit fp32 or the device's bf16/fp16; "
                                        "or force one for the whole model."),
    world_size: Optional[str] = typer.Option(None, "--world-size", help="Plan per GPU for FSDP sharding over N GPUs "
                                             "(parameters, gradients, optimizer state 1/N each), or auto: the fewest GPUs "
                                             "that fit, with the per-GPU peak against N."),
    units: Optional[list[str]] = UNITS,
    reserve: Optional[str] = typer.Option(None, "--reserve", help='Bytes held back from the budget, e.g. "1GB" or 0. '
                                          "Default: CUDA context + 5% fragmentation."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write the plan and advice as JSON to this file "
                                             "(- for stdout; the report then goes to stderr)."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="Write memory over the training step, before and after the "
                                        "plan, to this .png/.svg/.pdf (needs matplotlib)."),
    time_limit: float = typer.Option(10.0, "--time-limit", help="Seconds the solver may take per solve."),
    allow_over_device: bool = typer.Option(False, "--allow-over-device", help="Plan for a budget above the device's "
                                           "memory (an error otherwise); the report says it fits the budget, not the device."),
    moe_capacity: Optional[float] = MOE_CAPACITY,
    fuse_loss: bool = FUSE_LOSS,
    compiled: bool = COMPILE,
    offload: Optional[bool] = OFFLOAD,
    host_budget: Optional[str] = HOST_BUDGET,
    ladder: bool = LADDER,
    verbose: bool = VERBOSE,
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks and torch's own output."),
) -> None:
    """Plan TARGET for a budget: will it train, with what, and what to change if not."""
    out, err = Console(highlight=False), Console(file=sys.stderr)  # bound now: planning may swap sys.stderr
    with reported(debug):
        _check_options(budget, device, reserve, world_size, plot, time_limit, allow_over_device, moe_capacity, ladder, json_path)
        options = _plan_options(device, optimizer, precision, units, reserve, _loop(drop_outputs, accumulation_steps, optimizer_impl),
                                world_size) | dict(time_limit_s=time_limit, allow_over_device=allow_over_device, moe_capacity=moe_capacity,
                                                      fuse_loss=fuse_loss, compile=compiled, offload=offload, host_budget=host_budget)
        progress = PlanningProgress(err, enabled=progress_wanted(sys.stdout, err, json_to_stdout=_is_stdout(json_path)))
        from autoplan.inputs.targets import load_target
        from autoplan.report.text import report_renderables

        with progress, quiet(debug), prints_to_stderr(err.file, when=_is_stdout(json_path)):
            loaded = load_target(target, batch_size=batch_size, seq_len=seq_len)
            plan, profile = _plan(loaded, budget, options, progress)
            advice = _advise(loaded, plan, profile, budget, options, progress, world_size=world_size,
                             ladder=_ladder(loaded, budget, options, device, progress) if ladder else None)
        _write_files(json_path, plot, json_document(loaded, plan, advice, budget), plan, profile, err)
        print_report(err if _is_stdout(json_path) else out, report_renderables(plan, advice, budget_text=budget, verbose=verbose))
    raise typer.Exit(int(ExitCode.FITS if plan.outcome.feasible else ExitCode.DOES_NOT_FIT))


def _advise(loaded: LoadedTarget, plan, profile, budget: str, options: dict, progress, *, world_size: Optional[str], ladder):
    """What to change, in order (FSDP's step for the plan's world size where --world-size was given); a smaller
    micro-batch is planned again where the factory can rebuild the batch."""
    from autoplan.report.advice import advise

    rebuild = loaded.rebuild

    def replan(micro: int, loop: TrainingLoop):
        assert rebuild is not None  # passed only when the target has one
        progress(f"checking micro-batch {micro}: planning again")
        model, inputs = rebuild(micro)
        return _plan(loaded, budget, options | {"loop": loop}, progress, inputs=inputs, model=model)[0]

    return advise(plan, profile, batch_size=loaded.batch_size, seq_len=loaded.seq_len, mesh=plan.request.mesh if world_size else None,
                  parameter_count=loaded.parameter_count, replan=replan if rebuild else None, ladder=ladder)


def _ladder(loaded: LoadedTarget, budget: str, options: dict, device: Optional[str], progress):
    """The toolbox ladder of a Hugging Face target: its variants planned with every block in the device's low precision."""
    from autoplan.inputs.hf_models import is_hf_model
    from autoplan.report.ladder import plan_ladder

    if not is_hf_model(loaded.model):
        raise CliError(ExitCode.USAGE, f"--ladder takes a Hugging Face model (hf:CONFIG, or a factory returning a transformers "
                       f"model); {loaded.spec} gives a {type(loaded.model).__name__}")
    low = get_device(device).low_precision_name
    variant_options = {name: value for name, value in options.items() if name != "world_size"} | {"precision": low}  # one GPU

    def plan_variant(model):
        return _plan(loaded, budget, variant_options, progress, model=model)

    return plan_ladder(loaded.model, plan_variant, budget_text=budget, say=progress)


def _write_files(json_path: Optional[Path], plot: Optional[Path], document: dict, plan, profile, err: Console) -> None:
    """--json and --plot, before the report: a reader that stops early (`| head`) must not cost them."""
    if json_path is not None:
        _write(json_path, json.dumps(document, indent=2) + "\n", err)
    if plot is not None:
        from autoplan.report.plot import plot_memory

        try:
            plot_memory(plan, profile, plot)
        except OSError as error:
            raise CliError(ExitCode.OUTPUT_FAILED, f"cannot write {plot}: {error.strerror or error}") from error
        err.print(f"wrote {plot}", markup=False)


@app.command("verify", cls=OptionsGivenOnce)
def verify_command(
    target: str = typer.Argument(..., help="As for `autoplan plan`; hf: models are built with random weights."),
    budget: str = typer.Option(..., "--budget", "-b", help='Memory for the training step: "24GB", "80%" of the device.'),
    steps: int = typer.Option(3, "--steps", min=2, help="Real training steps to run (the first warms up)."),
    on: Optional[str] = typer.Option(None, "--on", help="Where to run: cuda or cpu. Default: cuda if there is a GPU."),
    batch_size: Optional[int] = typer.Option(None, "--batch-size", min=1, help="Batch size, passed to the factory."),
    seq_len: Optional[int] = typer.Option(None, "--seq-len", min=1, help="Sequence length, passed to the factory."),
    optimizer: Optimizer = typer.Option(Optimizer.adamw, "--optimizer", help="Optimizer to count and to train with; the 8-bit and paged ones are bitsandbytes' (pip install -e \".[qlora]\")."),
    drop_outputs: bool = DROP_OUTPUTS,
    accumulation_steps: int = ACCUMULATION_STEPS,
    optimizer_impl: OptimizerImpl = OPTIMIZER_IMPL,
    precision: Precision = typer.Option(Precision.auto, "--precision", help="As for `autoplan plan`."),
    units: Optional[list[str]] = typer.Option(None, "--units", help="As for `autoplan plan`."),
    reserve: Optional[str] = typer.Option(None, "--reserve", help="As for `autoplan plan`."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write the plan and the measurement as JSON to this file "
                                             "(- for stdout; the table then goes to stderr)."),
    fuse_loss: bool = FUSE_LOSS,
    compiled: bool = typer.Option(False, "--compile", help="Plan as `autoplan plan --compile` does; the real steps run "
                                  "eagerly (the plan's peaks are the eager model's), so the measured time is not the "
                                  "compiled model's."),
    offload: Optional[bool] = OFFLOAD,
    host_budget: Optional[str] = HOST_BUDGET,
    verbose: bool = VERBOSE,
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks and torch's own output."),
) -> None:
    """Plan TARGET, then train real steps of the planned model and measure whether the plan held.

    On a GPU the budget is enforced and the peak is torch.cuda.max_memory_allocated; on the CPU it is
    the live tensor bytes of the real run. Exit code 0 when it held, 9 when it did not.
    """
    out, err = Console(highlight=False), Console(file=sys.stderr)
    with reported(debug):
        where = _where(on, budget, reserve)
        from autoplan.inputs.targets import load_target
        from autoplan.report.text import report_renderables
        from autoplan.report.verification import verification_renderables
        from autoplan.verify.real import verify

        device = None if where == "cuda" else "cpu"  # plan for the device the steps run on
        _check_options(budget, device, reserve, None, None, json_path=json_path)
        to_stdout = _is_stdout(json_path)
        progress = PlanningProgress(err, enabled=progress_wanted(sys.stdout, err, json_to_stdout=to_stdout))
        with progress, quiet(debug), prints_to_stderr(err.file, when=to_stdout):
            loaded = load_target(target, batch_size=batch_size, seq_len=seq_len, meta=False)
            if any(parameter.is_meta for parameter in loaded.model.parameters()):
                raise CliError(ExitCode.USAGE, f"{target} returns a model on the meta device: verify trains real steps, so the "
                               "factory must build real (random) weights; autoplan plan takes a meta model")
            model = loaded.model.to(where)
            inputs = _to_device(loaded.example_inputs, where)
            loop = _loop(drop_outputs, accumulation_steps, optimizer_impl)
            options = _plan_options(device, optimizer, precision, units, reserve, loop) | dict(
                fuse_loss=fuse_loss, compile=compiled, offload=offload, host_budget=host_budget)
            plan, _ = _plan(loaded, budget, options, progress, inputs=inputs, model=model)
            if plan.outcome.feasible:
                progress(f"training {steps} real steps on {where}")
                result = verify(model, plan, example_inputs=inputs, steps=steps, optimizer=optimizer.value)
        if not plan.outcome.feasible:
            print_report(err if to_stdout else out, report_renderables(plan, budget_text=budget, verbose=verbose))
            raise typer.Exit(int(ExitCode.DOES_NOT_FIT))
        if json_path is not None:
            document = {"schema": "autoplan.verify/1", "target": target, "budget": budget,
                        "plan": plan.to_dict(), "verification": result.to_dict()}
            _write(json_path, json.dumps(document, indent=2) + "\n", err)
        print_report(err if to_stdout else out, verification_renderables(plan, result, verbose))
    raise typer.Exit(int(ExitCode.FITS if result.held else ExitCode.DID_NOT_HOLD))


def _where(on: Optional[str], budget: str, reserve: Optional[str]) -> str:
    """verify's --on: cuda or cpu (default: cuda if this machine has it); a typo in it or in the budget is
    answered before torch is imported to find a GPU."""
    if on not in (None, "cuda", "cpu"):
        raise CliError(ExitCode.USAGE, f"--on must be cuda or cpu; got {on!r}")
    check_size_syntax(budget, reserve)
    import torch

    if on == "cuda" and not torch.cuda.is_available():
        raise CliError(ExitCode.USAGE, "--on cuda: this machine has no CUDA device; use --on cpu")
    return on or ("cuda" if torch.cuda.is_available() else "cpu")


def _to_device(inputs, where: str):
    import torch
    from torch.utils._pytree import tree_map_only

    return tree_map_only(torch.Tensor, lambda t: t.to(where), inputs)


@app.command("devices")
def devices_command() -> None:
    """List the device profiles a plan can target (--device NAME)."""
    table = Table(title="device profiles: dense datasheet rates", caption="GiB = 2³⁰ bytes (what vendors call GB), "
                  "GB = 10⁹ bytes; a card of your own: --device custom:memory=48GiB,fp32_tflops=91.6,bandwidth=864GB/s,...")
    table.add_column("name", justify="left")
    for column in ("memory", "sm", "fp32", "low precision", "bandwidth"):
        table.add_column(column, justify="right")
    for device in list_devices():
        low = device.peak_flops.get(device.low_precision_name, device.peak_flops["fp32"])
        memory = f"{device.memory_bytes / 2**30:.0f} GiB ({device.memory_bytes / 1e9:.1f} GB)"
        capability = ".".join(map(str, device.compute_capability)) if device.compute_capability else "-"
        table.add_row(device.name, memory, capability, f"{device.peak_flops['fp32'] / 1e12:g} TF",
                      f"{device.low_precision_name} {low / 1e12:g} TF", f"{device.memory_bandwidth / 1e9:g} GB/s")
    Console(highlight=False).print(table)


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"autoplan {autoplan.__version__}")
        raise typer.Exit(0)


@app.callback()
def main(
    version: bool = typer.Option(False, "--version", help="Print the version and exit.", is_eager=True,
                                 callback=_print_version),
) -> None:
    """autoplan: make a PyTorch training step fit a memory budget."""
