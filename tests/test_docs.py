"""The docs say what the code does: the options tables, every flag and keyword, the values accepted, the exit codes.

The options tables are the schema's: docs/api.md's from `PlanOptions`, docs/command-line.md's from the
flags `autoplan plan` takes. Each table stands between a `<!-- table: ... -->` line and
`<!-- end of table -->`; an option added, renamed or re-documented in `autoplan/inputs/options.py`
changes the table, and the first test fails until the docs are written again:

    python -m tests.test_docs   # rewrites both tables

The others read what is written by hand against the code itself: every flag the command line parses,
the keywords of the public functions, the optimizer names, custom-device keys and device profiles the
code accepts, what the docs read off a `Plan`, the exit-code table against `EXIT_CODES`, and the
memory `autoplan devices` shows. The paths and links the docs name: tests/test_docs_paths.py.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Callable

import pytest

from autoplan.cli.app import plan_command
from autoplan.cli.flags import options_table
from autoplan.inputs.options import api_table

DOCS = Path(__file__).resolve().parents[1] / "docs"
_TABLE = re.compile(r"(<!-- table: [^\n]*-->\n)(.*?)(<!-- end of table -->)", re.S)

TABLES: dict[str, Callable[[], str]] = {
    "api.md": api_table,
    "command-line.md": lambda: options_table(plan_command),
}


def written_table(text: str, name: str) -> str:
    """The one generated table of a docs page."""
    found = _TABLE.findall(text)
    assert len(found) == 1, f"docs/{name} should hold one '<!-- table: ... -->' block, holds {len(found)}"
    return found[0][1]


@pytest.mark.parametrize("name", sorted(TABLES))
def test_the_docs_table_is_the_schemas(name):
    assert written_table((DOCS / name).read_text(), name) == TABLES[name](), (
        f"docs/{name}'s options table differs from the schema's: run `python -m tests.test_docs`")


def test_the_tables_name_every_option():
    # the check above would pass on two empty tables: the schema's own names must be rows of them
    from dataclasses import fields

    from autoplan.inputs.options import PlanOptions

    api = api_table()
    assert all(f"| `{option.name}` |" in api for option in fields(PlanOptions))
    command_line = options_table(plan_command)
    for flag in ("`--budget`", "`--world-size N`", "`--offload` / `--no-offload`", "`--host-budget SIZE`"):
        assert flag in command_line


def section(text: str, heading: str) -> str:
    """The part of a page under a `## heading`, up to the next one."""
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end != -1 else len(text)]


def flags_of(command) -> set[str]:
    """Every name a click command's options answer to: `--budget`, `-b`, `--no-offload`, ..."""
    return {name for param in command.params if getattr(param, "param_type_name", "") == "option"
            for name in (*param.opts, *param.secondary_opts)}


def flag_written(flag: str, text: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text) is not None


def test_every_flag_the_command_line_parses_is_documented():
    # the table above is made from each command's `.flags`: a flag added to a command another way, or one
    # `autoplan verify` takes that its paragraph forgets, would be parsed and never documented
    import typer

    from autoplan.cli.app import app

    page = (DOCS / "command-line.md").read_text()
    commands = typer.main.get_command(app).commands  # type: ignore[attr-defined]
    places = {"plan": written_table(page, "command-line.md"), "verify": section(page, "`autoplan verify`"), "devices": page}
    # the plan table names short flags too (`-b`); elsewhere the long name is enough
    undocumented = [f"autoplan {name} {flag}" for name, command in commands.items() for flag in sorted(flags_of(command))
                    if (name == "plan" or flag.startswith("--")) and not flag_written(flag, places[name])]
    undocumented += [f"autoplan {flag}" for flag in sorted(flags_of(typer.main.get_command(app))) if not flag_written(flag, page)]
    assert not undocumented, f"flags docs/command-line.md does not name where it documents the command: {undocumented}"
    assert "--on" in flags_of(commands["verify"]) and "--no-offload" in flags_of(commands["plan"])  # read, not empty


def table_row(table: str, first_cell: str) -> str:
    return next(line for line in table.splitlines() if line.startswith(f"| {first_cell} |"))


def test_the_accepted_values_are_the_documented_ones():
    # the rows are written by hand (in options.py's docs lines); the values are what the code accepts
    from autoplan.inputs import options
    from autoplan.inputs.devices import CUSTOM_KEYS, DEVICES
    from autoplan.training.step_parts import OPTIMIZERS

    command_line = written_table((DOCS / "command-line.md").read_text(), "command-line.md")
    api = written_table((DOCS / "api.md").read_text(), "api.md")
    assert set(options.OPTIMIZERS) == set(OPTIMIZERS), "--optimizer's choices are not the names the step counts"
    optimizers = (DOCS / "optimizers.md").read_text()
    for name in OPTIMIZERS:
        assert f"`{name}`" in table_row(command_line, "`--optimizer`"), f"--optimizer's row leaves out {name}"
        assert f"`{name}`" in optimizers, f"docs/optimizers.md leaves out {name}"
    for key in CUSTOM_KEYS:
        assert f"`{key}`" in table_row(command_line, "`--device`, `-d`"), f"--device's row leaves out the custom key {key}"
    for name in DEVICES:
        assert f"`{name}`" in table_row(api, "`device`"), f"api.md's device row leaves out the profile {name}"


def test_every_keyword_of_the_public_functions_is_in_api_md():
    # PlanOptions' fields are the table's rows (above); these are the other functions' own keywords
    import inspect

    import autoplan

    api = (DOCS / "api.md").read_text()
    functions = (autoplan.apply, autoplan.verify, autoplan.format_report, autoplan.Planner)
    missing = [f"{function.__name__}({name}=)" for function in functions
               for name, parameter in inspect.signature(function).parameters.items()
               if parameter.kind == parameter.KEYWORD_ONLY and not re.search(rf"`{name}`|\b{name}=", api)]
    assert not missing, f"keywords docs/api.md never names: {missing}"


def plan_reads(text: str) -> set[tuple[str, str]]:
    """What a page reads off a plan: `plan.decisions.fused_loss` as ("decisions", "fused_loss"), `plan.report()`
    as ("report", ""); not `autoplan.plan(...)`, `planner.plan(...)` nor the file `plan.py`."""
    return {(first, second or "") for first, second in re.findall(r"(?<![\w.])plan\.(?!py\b)(\w+)(?:\.(\w+))?", text)}


def test_what_the_docs_read_off_a_plan_is_there():
    # the docs said `plan.choices()`: the Plan has no such method, its `decisions` has
    import dataclasses
    import typing

    from autoplan.plan import Plan
    from autoplan.report.reported import ReportedPlan

    def has(kind: type, name: str) -> bool:
        return hasattr(kind, name) or (dataclasses.is_dataclass(kind) and name in {f.name for f in dataclasses.fields(kind)})

    parts = typing.get_type_hints(Plan)  # plan.decisions -> Decisions, ...: the second name is read off that part
    pages = (DOCS.parent / "README.md", *sorted(DOCS.glob("*.md")))
    wrong = [f"{page.name}: plan.{first}" + (f".{second}" if second else "") for page in pages
             for first, second in sorted(plan_reads(page.read_text()))
             if not has(ReportedPlan, first) or (second and first in parts and not has(parts[first], second))]
    assert not wrong, f"the docs read what a Plan does not have: {wrong}"
    assert ("decisions", "fused_loss") in plan_reads((DOCS / "api.md").read_text())  # read, not empty


def exit_code_rows(page: str) -> dict[int, set[str]]:
    """docs/command-line.md's exit-code table: each code and the names of the classes its "raised as" cell gives."""
    rows = [line.split("|") for line in section(page, "Exit codes").splitlines() if re.match(r"\| \d+ \|", line)]
    return {int(cells[1]): set(re.findall(r"`([A-Z]\w*)`", cells[-2])) for cells in rows}


def test_the_exit_code_table_is_the_clis():
    import builtins

    from autoplan import errors
    from autoplan.cli.exits import EXIT_CODES, ExitCode

    rows = exit_code_rows((DOCS / "command-line.md").read_text())
    assert set(rows) == {int(code) for code in ExitCode}, "the table's codes are not ExitCode's"
    for kind, code in EXIT_CODES:
        assert kind.__name__ in rows[code], f"{kind.__name__} exits {int(code)}; the table's row {int(code)} does not name it"
    for code, names in rows.items():
        for name in names:
            kind = getattr(errors, name, None) or getattr(builtins, name, None)
            assert isinstance(kind, type) and issubclass(kind, BaseException), f"row {code} names {name}: no error class"
            if kind.__module__ == errors.__name__:  # a subclass exits as the first class of EXIT_CODES it is one of
                exits = next((int(c) for parent, c in EXIT_CODES if issubclass(kind, parent)), int(ExitCode.ERROR))
                assert exits == code, f"{name} exits {exits}, the table says {code}"


def test_autoplan_devices_says_the_memory_there_is():
    # the docs send readers to `autoplan devices` to see a profile's memory; its cpu row said 24 GiB on a
    # machine of 23.5 (rounded to the GiB): a card's whole GiB stays whole, anything else is cut to 0.1 GiB
    from typer.testing import CliRunner

    from autoplan.cli.app import app, gib_text
    from autoplan.inputs.devices import get_device

    assert (gib_text(80 * 2**30), gib_text(int(23.54 * 2**30)), gib_text(24 * 2**30 - 1)) == ("80", "23.5", "23.9")
    cpu = get_device("cpu").memory_bytes
    row = next(line for line in CliRunner().invoke(app, ["devices"]).output.splitlines() if line.startswith("cpu "))
    assert f" {gib_text(cpu)} GiB ({cpu / 1e9:.1f} GB) " in row and cpu >= float(gib_text(cpu)) * 2**30


def test_the_readme_samples_are_the_commands_output():
    # the README's sample outputs went stale by hand (a ladder made before its rungs took the plan's options):
    # each is marked with the sample of tests/readme_samples.py that writes it, and opens with that command
    from tests.readme_samples import BY_NAME, README, Sample, with_sample, written_samples

    text = README.read_text()
    written = written_samples(text)
    assert set(written) == set(BY_NAME), "a sample block of the README is unmarked, or a sample has no block"
    for name, block in written.items():
        sample = BY_NAME[name]
        assert not sample.prompt or block.splitlines()[0] == sample.typed(), f"{name} does not open with its command"
        assert re.search(rf"<!-- sample: {name} · python -m tests.readme_samples {name} · \d{{4}}-\d\d-\d\d, \d+ s on ", text)
    unmarked = re.findall(r"(?<!-->\n)```\n(\$ autoplan [^\n]*)\n", text)
    assert unmarked == [], f"output blocks no sample writes: {unmarked}"
    # the cut keeps the runs asked for, `...` where lines are left out, and the block replaced is the one named
    cut = Sample("x", ("autoplan", "plan", "m.py:build"), prompt=True, runs=((r"^b", r"^d"), (r"^e", None)))
    assert cut.shown("a\nb\nc\nd\ne\nf\n") == "$ autoplan plan m.py:build\n...\nb\nc\n...\ne\nf\n"
    two = "<!-- sample: x -->\n```\nold\n```\n<!-- sample: y -->\n```\nkept\n```\n"
    assert written_samples(with_sample(two, "x", "new\n", "note")) == {"x": "new\n", "y": "kept\n"}
    with pytest.raises(ValueError, match="no line matches"):
        cut.shown("a\nc\n")


def write_tables() -> None:
    for name, table in TABLES.items():
        path = DOCS / name
        text = path.read_text()
        written_table(text, name)
        path.write_text(_TABLE.sub(lambda match: match.group(1) + table() + match.group(3), text))


if __name__ == "__main__":
    write_tables()
