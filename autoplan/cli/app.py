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
from autoplan.cli.flags import OUTPUTS, RUN, TARGET, VERIFY_TARGET, CommandLine, OptionsGivenOnce, with_flags
from autoplan.cli.progress import PlanningProgress, progress_wanted
from autoplan.inputs.budget import make_budget, read_budget, read_reserve
from autoplan.inputs.devices import get_device, list_devices
from autoplan.inputs.loop import TrainingLoop
from autoplan.inputs.settings import check_time_limit
from autoplan.report.plot import FORMATS, require_pyplot
from autoplan.vocabulary.sizes import Size

# Everything that imports torch (seconds) is imported inside the commands, after the options are
# checked: `--help` and a mistyped option are answered at once (tests/cli/test_app.py checks that
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


def _read_sizes(cli: CommandLine) -> tuple[Size, Size | None]:
    """The budget and the reserve, read once, before torch is imported: what planning is handed is what was read."""
    return read_budget(cli.budget), read_reserve(cli.reserve)  # BudgetError: exit 2


def _check_options(cli: CommandLine, budget: Size, reserve: Size | None, device: Optional[str]) -> dict:
    """Every option's value, before minutes of planning; those that need no torch before seconds of its imports.
    Returns autoplan.plan's keywords, the reserve as read."""
    plot = cli.given.get("plot")
    _check_outputs(json=cli.json_path, plot=plot)
    options = cli.options() | {"reserve": reserve}  # --world-size: exit 2
    check_time_limit(options.get("time_limit_s", 10.0))  # OptionError: exit 2
    if plot is not None and plot.suffix.lower() not in FORMATS:
        raise CliError(ExitCode.USAGE, f"--plot file must end in {', '.join(FORMATS)}; got {plot.name!r}")
    # DeviceError: exit 2 (this machine's GPU: torch); a budget over the device's memory, exit 2, before the model loads
    make_budget(budget, get_device(device), reserve, allow_over_device=options.get("allow_over_device", False))
    from autoplan.instruments.routing import check_moe_capacity
    from autoplan.inputs.qlora_twin import check_qlora_installed

    check_moe_capacity(options.get("moe_capacity"))  # OptionError: exit 2
    if cli.given.get("ladder"):
        check_qlora_installed("--ladder")  # MissingExtraError, exit 7
    if plot is not None:
        require_pyplot()  # PlotUnavailable is exit 7
    return options


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


def _plan(target: LoadedTarget, budget: Size, options: dict, progress, inputs=None, model=None):
    from autoplan.api import plan as plan_model

    profiles: list[Profile] = []
    try:
        # `model or ...` would call bool() on the user's module: a torch.compile'd one answers with its len()
        plan = plan_model(target.model if model is None else model, budget,
                          example_inputs=inputs if inputs is not None else target.example_inputs,
                          progress=progress, on_profile=profiles.append, **options)
    except Exception as error:
        if exit_code_for(error) != ExitCode.ERROR:
            raise  # autoplan's own errors: mapped by class
        # anything else the target's model raised while planning: what it was, not a bug of autoplan
        raise CliError(ExitCode.CANNOT_PLAN, f"cannot plan {type(target.model).__name__}: {type(error).__name__}: {error}") from error
    return plan, (profiles[0] if profiles else None)  # none for a plan decided by counting (solve.states_bound)


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
@with_flags("plan", OUTPUTS)
def plan_command(target: str = TARGET, cli: CommandLine = None) -> None:  # type: ignore[assignment]  # with_flags passes it
    """Plan TARGET for a budget: will it train, with what, and what to change if not."""
    out, err = Console(highlight=False), Console(file=sys.stderr)  # bound now: planning may swap sys.stderr
    with reported(cli.debug):
        budget, reserve = _read_sizes(cli)
        options = _check_options(cli, budget, reserve, cli.device)
        progress = PlanningProgress(err, enabled=progress_wanted(sys.stdout, err, json_to_stdout=_is_stdout(cli.json_path)))
        from autoplan.inputs.targets import load_target
        from autoplan.report.text import report_renderables

        with progress, quiet(cli.debug), prints_to_stderr(err.file, when=_is_stdout(cli.json_path)):
            loaded = load_target(target, batch_size=cli.batch_size, seq_len=cli.seq_len)
            base = ladder_base(loaded.model, loaded.spec) if cli.ladder else None  # what the ladder needs, said before planning
            plan, profile = _plan(loaded, budget, options, progress)
            ladder = _ladder(loaded, base, budget, options, progress) if base is not None else None
            advice = _advise(loaded, plan, profile, budget, options, progress, world_size=cli.world_size, ladder=ladder)
        _write_files(cli.json_path, cli.plot, json_document(loaded, plan, advice, cli.budget), plan, profile, err)
        renderables = report_renderables(plan, advice, budget_text=cli.budget, verbose=cli.verbose)
        print_report(err if _is_stdout(cli.json_path) else out, renderables)
    raise typer.Exit(int(ExitCode.FITS if plan.outcome.feasible else ExitCode.DOES_NOT_FIT))


def _advise(loaded: LoadedTarget, plan, profile, budget: Size, options: dict, progress, *, world_size: Optional[str], ladder):
    """What to change, in order (FSDP's step for the plan's world size where --world-size was given); a smaller
    micro-batch is planned again where the factory can rebuild the batch."""
    from autoplan.report.advice import advise

    if profile is None:  # decided by counting the states: advice from the counts alone
        from autoplan.inputs.devices import get_device
        from autoplan.report.counted_advice import counted_advice

        return counted_advice(plan, get_device(options.get("device")), parameter_count=loaded.parameter_count, ladder=ladder)
    rebuild = loaded.rebuild

    def replan(micro: int, loop: TrainingLoop):
        assert rebuild is not None  # passed only when the target has one
        progress(f"checking micro-batch {micro}: planning again")
        model, inputs = rebuild(micro)
        return _plan(loaded, budget, options | {"loop": loop}, progress, inputs=inputs, model=model)[0]

    return advise(plan, profile, batch_size=loaded.batch_size, seq_len=loaded.seq_len, mesh=plan.request.mesh if world_size else None,
                  parameter_count=loaded.parameter_count, replan=replan if rebuild else None, ladder=ladder)


def _ladder(loaded: LoadedTarget, base, budget: Size, options: dict, progress):
    """The toolbox ladder of a Hugging Face target: its variants planned with the plan's own options."""
    from autoplan.report.ladder import plan_ladder

    # the plan's own options (one GPU): the rung that adds autoplan's checkpointing is the plan printed above the ladder
    # simulated even where the states alone are over the budget: a rung is priced from its profile
    variant_options = {name: value for name, value in options.items() if name != "world_size"} | {"count_first": False}

    def plan_variant(model):
        return _plan(loaded, budget, variant_options, progress, model=model)

    return plan_ladder(base, plan_variant, budget_text=str(budget.given), say=progress)


def ladder_base(model, spec: str):
    """The full-precision transformers model the ladder starts from, on the meta device (its variants cost no memory):
    a model with real weights is rebuilt there from its config; one that is already peft or quantized is refused in
    one line, since the ladder adds 4-bit QLoRA itself."""
    import torch

    from autoplan.inputs.hf_models import is_hf_model
    from autoplan.instruments.quantized import has_quantized_base

    name = type(model).__name__
    if hasattr(model, "peft_config") or has_quantized_base(model):
        raise CliError(ExitCode.USAGE, f"--ladder starts from the full-precision model and adds 4-bit QLoRA itself; {spec} gives "
                       f"a {name} that already has {'adapters' if hasattr(model, 'peft_config') else 'a quantized base'}: give "
                       "the base model (hf:CONFIG, or a factory returning the transformers model)")
    if not is_hf_model(model):
        raise CliError(ExitCode.USAGE, f"--ladder takes a Hugging Face model (hf:CONFIG, or a factory returning a transformers "
                       f"model); {spec} gives a {name}")
    if all(p.is_meta for p in model.parameters()):
        return model
    with torch.device("meta"):
        return type(model)(model.config)


def _write_files(json_path: Optional[Path], plot: Optional[Path], document: dict, plan, profile, err: Console) -> None:
    """--json and --plot, before the report: a reader that stops early (`| head`) must not cost them."""
    if json_path is not None:
        _write(json_path, json.dumps(document, indent=2) + "\n", err)
    if plot is not None and profile is None:
        err.print(f"no plot written to {plot}: the plan was decided by counting the states, and no step was simulated to "
                  "draw (--simulate-anyway draws it)", markup=False)
    elif plot is not None:
        from autoplan.report.plot import plot_memory

        try:
            plot_memory(plan, profile, plot)
        except OSError as error:
            raise CliError(ExitCode.OUTPUT_FAILED, f"cannot write {plot}: {error.strerror or error}") from error
        err.print(f"wrote {plot}", markup=False)


@app.command("verify", cls=OptionsGivenOnce)
@with_flags("verify", RUN | {name: OUTPUTS[name] for name in ("json_path", "verbose", "debug")})
def verify_command(target: str = VERIFY_TARGET, cli: CommandLine = None) -> None:  # type: ignore[assignment]  # with_flags passes it
    """Plan TARGET, then train real steps of the planned model and measure whether the plan held.

    On a GPU the budget is enforced and the peak is torch.cuda.max_memory_allocated; on the CPU it is
    the real run as the CPU allocator counts it (verify/allocator.py). Exit code 0 when it held, 9 when it did not.
    """
    out, err = Console(highlight=False), Console(file=sys.stderr)
    with reported(cli.debug):
        _check_on(cli.on)
        budget, reserve = _read_sizes(cli)
        where = _where(cli.on)
        device = None if where == "cuda" else "cpu"  # plan for the device the steps run on
        options = _check_options(cli, budget, reserve, device) | {"device": device}
        to_stdout = _is_stdout(cli.json_path)
        progress = PlanningProgress(err, enabled=progress_wanted(sys.stdout, err, json_to_stdout=to_stdout))
        with progress, quiet(cli.debug), prints_to_stderr(err.file, when=to_stdout):
            plan, result = _plan_and_train(target, cli, budget, options, where, progress)
        if result is None:
            from autoplan.report.text import report_renderables

            print_report(err if to_stdout else out, report_renderables(plan, budget_text=cli.budget, verbose=cli.verbose))
            raise typer.Exit(int(ExitCode.DOES_NOT_FIT))
        if cli.json_path is not None:
            document = {"schema": "autoplan.verify/1", "target": target, "budget": cli.budget,
                        "plan": plan.to_dict(), "verification": result.to_dict()}
            _write(cli.json_path, json.dumps(document, indent=2) + "\n", err)
        from autoplan.report.verification import verification_renderables

        print_report(err if to_stdout else out, verification_renderables(plan, result, cli.verbose))
    raise typer.Exit(int(ExitCode.FITS if result.held else ExitCode.DID_NOT_HOLD))


def _plan_and_train(target: str, cli: CommandLine, budget: Size, options: dict, where: str, progress):
    """verify's work: the target built with real weights where the steps run, planned, and trained when the plan
    fits; (plan, the verification, or None when it does not fit)."""
    from autoplan.inputs.targets import load_target
    from autoplan.verify.real import verify

    loaded = load_target(target, batch_size=cli.batch_size, seq_len=cli.seq_len, meta=False)
    if any(parameter.is_meta for parameter in loaded.model.parameters()):
        raise CliError(ExitCode.USAGE, f"{target} returns a model on the meta device: verify trains real steps, so the "
                       "factory must build real (random) weights; autoplan plan takes a meta model")
    model = loaded.model.to(where)
    inputs = _to_device(loaded.example_inputs, where)
    plan, _ = _plan(loaded, budget, options, progress, inputs=inputs, model=model)
    if not plan.outcome.feasible:
        return plan, None
    progress(f"training {cli.steps} real steps on {where}")
    return plan, verify(model, plan, example_inputs=inputs, steps=cli.steps, optimizer=options["optimizer"])


def _check_on(on: Optional[str]) -> None:
    """verify's --on: cuda or cpu; a typo is answered before torch is imported to find a GPU."""
    if on not in (None, "cuda", "cpu"):
        raise CliError(ExitCode.USAGE, f"--on must be cuda or cpu; got {on!r}")


def _where(on: Optional[str]) -> str:
    """Where verify's steps run: --on, or cuda if this machine has it."""
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
    table = Table(title="device profiles: dense datasheet rates, TFLOP/s and GB/s", caption="GiB = 2³⁰ bytes (what vendors "
                  "call GB), GB = 10⁹ bytes; low: the low precision and its rate; mem: memory bandwidth; link: to the card's "
                  "peers / between nodes per GPU, each way (tensor parallelism's collectives; the network's above 8 ranks); "
                  "a card of your own: "
                  "--device custom:memory=48GiB,fp32_tflops=91.6,bandwidth=864GB/s,...", box=None, pad_edge=False)
    table.add_column("name", justify="left")
    for column in ("memory", "sm", "fp32", "low", "float8", "mem/s", "link/s"):
        table.add_column(column, justify="right", no_wrap=True)
    for device in list_devices():
        low = device.peak_flops.get(device.low_precision_name, device.peak_flops["fp32"])
        memory = f"{gib_text(device.memory_bytes)} GiB ({device.memory_bytes / 1e9:.1f} GB)"
        capability = ".".join(map(str, device.compute_capability)) if device.compute_capability else "-"
        float8 = f"{device.peak_flops['float8'] / 1e12:g}" if "float8" in device.peak_flops else "-"
        link = f"{device.interconnect_bandwidth / 1e9:g}/{device.network_bandwidth / 1e9:g}" if device.interconnect_bandwidth else "-"
        table.add_row(device.name, memory, capability, f"{device.peak_flops['fp32'] / 1e12:g}",
                      f"{device.low_precision_name} {low / 1e12:g}", float8, f"{device.memory_bandwidth / 1e9:g}", link)
    Console(highlight=False).print(table)


def gib_text(nbytes: int) -> str:
    """A memory in GiB as `autoplan devices` shows it: a card's whole GiB ("80"), else cut to one decimal
    ("23.5" for this machine's 23.54 GiB): rounded to the GiB, the cpu row claimed half a GiB it does not have."""
    tenths = nbytes * 10 // 2**30
    return f"{tenths // 10}" if nbytes % 2**30 == 0 else f"{tenths / 10:.1f}"


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
