"""Typed units (autoplan/units.py): every kind keeps today's name, and names are read back in one place only."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from autoplan.units import CallSite, GraphRun, ModuleUnit, Segment, SequentialRun, Unit, UnitKind

PACKAGE = Path(__file__).resolve().parent.parent / "autoplan"

EVERY_KIND = [
    (ModuleUnit("transformer.h.3"), "transformer.h.3", UnitKind.MODULE),
    (ModuleUnit("encoder"), "encoder", UnitKind.MODULE),
    (SequentialRun("features", 0, 4), "features[0:4]", UnitKind.SEQUENTIAL_RUN),
    (SequentialRun("", 10, 11), "[10:11]", UnitKind.SEQUENTIAL_RUN),  # the model itself is the Sequential
    (SequentialRun("model.layers.", 0, 2), "model.layers.[0:2]", UnitKind.SEQUENTIAL_RUN),
    (GraphRun("fc1", "relu"), "graph[fc1:relu]", UnitKind.GRAPH_RUN),
    (CallSite("block", 2), "block@2", UnitKind.CALL_SITE),
    (CallSite("model.shared", 0), "model.shared@0", UnitKind.CALL_SITE),
    (Segment("layers.0", "layers.3"), "layers.0\u2013layers.3", UnitKind.SEGMENT),
]


@pytest.mark.parametrize("unit, name, kind", EVERY_KIND)
def test_every_kind_round_trips_name_unit_name(unit: Unit, name: str, kind: UnitKind) -> None:
    assert unit.name == name == str(unit)
    assert unit.kind is kind
    parsed = Unit.from_name(name)
    assert parsed == unit and type(parsed) is type(unit)
    assert Unit.from_name(parsed.name) == unit


def test_units_are_values_one_per_kind_and_parts() -> None:
    assert len({unit for unit, _, _ in EVERY_KIND}) == len(EVERY_KIND)  # hashable: keys of a choices mapping
    assert ModuleUnit("a") != CallSite("a", 0) and SequentialRun("a", 0, 1) != SequentialRun("a", 0, 2)
    assert SequentialRun("net", 2, 4).layer_names() == ["net.2", "net.3"]
    assert ModuleUnit("layers.3").parent == "layers" and ModuleUnit("layers.3").child == "3"
    # the series a report folds alike rows of: numbered modules and calls, never a run or a segment
    assert [unit.numbered() for unit in (ModuleUnit("h.12"), ModuleUnit("layer3"), CallSite("block", 2))] == [
        ("h.", 12), ("layer", 3), ("block@", 2)]
    assert [unit.numbered() for unit in (ModuleUnit("head"), SequentialRun("f", 0, 2), GraphRun("a", "b2"), Segment("h.0", "h.3"))] == [None] * 4
    with pytest.raises(AttributeError):
        ModuleUnit("a").path = "b"  # type: ignore[misc]  # frozen


# The one parser of unit names, and where it may be called: the trace stage, which names the units it
# finds (and the calls it sees), and nothing later; every later stage asks a Unit for its kind and parts.
PARSER = "from_name"
MAY_PARSE = ("autoplan/units.py", "autoplan/trace/")
# stages before the trace have no units yet (device specs, "file.py:build" targets); batch_steps takes
# apart the batch's input names ("argument 0[1]"), not unit names
NO_UNITS = ("autoplan/inputs/", "autoplan/instruments/", "autoplan/training/", "autoplan/report/batch_steps.py")
# what the old name parsers were called, and a unit name's marks: none may come back outside the trace stage
OLD_PARSERS = {"sequential_run", "call_site", "segment_ends", "is_graph_unit", "is_range_unit", "GRAPH_UNIT", "RANGE_UNIT", "CALL_UNIT"}


def _where(path: Path) -> str:
    return path.relative_to(PACKAGE.parent).as_posix()


MARKS = ("\u2013", "@", "[")  # a segment's en dash, a call site's @, a run's brackets
SPLITTERS = {"partition", "rpartition", "split", "rsplit", "index", "find", "rfind", "startswith", "endswith"}


def _splits_on_a_mark(node: ast.AST) -> bool:
    """`name.partition("@")`, `"[" in name` and the like: a string taken apart at a mark of a unit name."""
    def is_mark(arg: ast.AST) -> bool:
        return isinstance(arg, ast.Constant) and isinstance(arg.value, str) and any(mark in arg.value for mark in MARKS)

    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in SPLITTERS:
        return any(is_mark(arg) for arg in node.args)
    if isinstance(node, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops):
        return is_mark(node.left)
    return False


def test_no_unit_name_is_parsed_outside_the_trace_stage() -> None:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        where = _where(path)
        if where.startswith(MAY_PARSE + NO_UNITS):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == PARSER:
                found.append(f"{where}:{node.lineno}: .{PARSER}")
            elif isinstance(node, ast.Name) and node.id in OLD_PARSERS | {PARSER}:
                found.append(f"{where}:{node.lineno}: {node.id}")
            elif isinstance(node, ast.alias) and node.name in OLD_PARSERS | {PARSER}:
                found.append(f"{where}:{node.lineno}: imports {node.name}")
            elif _splits_on_a_mark(node):
                found.append(f"{where}:{node.lineno}: splits a string at a unit name's mark")
    assert not found, "unit names parsed outside the trace stage (ask the Unit instead):\n" + "\n".join(found)


def test_the_check_sees_a_parse(tmp_path: Path) -> None:
    """The check above would pass vacuously if it missed a call of the parser."""
    source = "from autoplan.units import Unit\n\ndef kind(name):\n    return Unit.from_name(name).kind\n"
    calls = [node for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Attribute) and node.attr == PARSER]
    assert len(calls) == 1
    by_hand = "def module(name):\n    return name.partition('@')[0] if '@' in name else name\n"
    assert sum(map(_splits_on_a_mark, ast.walk(ast.parse(by_hand)))) == 2
