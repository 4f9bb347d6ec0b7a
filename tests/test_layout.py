"""The package's folder tree is the pipeline: imports go only towards earlier stages, in no circle.

Every `import` in every module counts, those inside functions and under TYPE_CHECKING too, with no
exception. A module of stage k may import the first words (errors, units), the shared packages
(vocabulary helpers, instruments, the choice axes, the plan, the training step, the planned forwards,
in that order), and stages before k; never a later stage, never its own stage's sibling in a circle. The
house style's limits (a module under ~400 lines, a function under ~60) are checked here too, so they stay true.
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx
import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "autoplan"

# The pipeline in order; a module may import its own layer and earlier ones.
LAYERS = (
    ("errors", "units", "mesh"),  # the first words: import nothing of autoplan (but each other)
    # shared by every stage, none imports a stage: each imports only those above it
    ("vocabulary",),  # unit names, formatting, signatures, tensors and bytes, a plan's fingerprint
    ("instruments",),  # fake twins, the live-bytes tracker, quantized bases' state, the MoE routing bound
    ("axes",),  # a room per choice axis: checkpoint mode, precision, placement
    ("plan",),  # the Plan a planning run returns, and the Choice of one value per axis
    ("training",),  # the training step: loss, optimizer, the one LoopRunner
    ("planned",),  # what a rewritten model runs: planned forwards, segments, graph units, the fused loss head
    ("inputs",),
    ("trace",),
    ("profile",),
    ("memory",),
    ("solve",),
    ("verify",),
    ("apply",),
    ("report",),
    ("deciding",),  # one profile planned at one budget: search, simulations, the allocator, the loss head both ways
    ("planner",),  # the stages run in order: profile once, solve per budget
    ("api",),
    ("hf", "frameworks"),  # the frameworks' loops: transformers' Trainer and trl (hf), accelerate and Lightning
    ("cli",),
    ("__init__", "__main__"),  # the package root re-exports the public names; `python -m autoplan` runs the command line
)
RANK = {name: rank for rank, names in enumerate(LAYERS) for name in names}
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60  # from `def` to the end, the docstring included


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _stage(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _imports(module: str, path: Path) -> set[str]:
    """Every autoplan module `module` imports, wherever the import statement stands."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    known = _modules()
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("autoplan"))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            if not base.startswith("autoplan"):
                continue
            for alias in node.names:  # `from autoplan.x import y` may name the module autoplan.x.y
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
    return {name for name in found if name != module}


def _graph() -> nx.DiGraph:
    graph = nx.DiGraph()
    for module, path in _modules().items():
        graph.add_node(module)
        for imported in _imports(module, path):
            graph.add_edge(module, imported)
    return graph


def test_the_stages_are_the_folders_in_pipeline_order():
    stages = {_stage(module) for module in _modules()}
    assert stages <= set(RANK), f"modules outside the pipeline: {stages - set(RANK)}"
    assert not (PACKAGE / "runtime").exists(), "runtime/ was split by purpose: vocabulary, instruments, training, planned"
    for package in ("vocabulary", "instruments", "axes", "training", "planned", "inputs", "trace", "profile", "memory", "solve", "verify", "apply", "report", "cli"):
        assert (PACKAGE / package / "__init__.py").exists(), package


def test_no_import_circle():
    cycles = list(nx.simple_cycles(_graph()))
    assert not cycles, f"import circles: {cycles[:5]}"


def test_imports_only_go_towards_earlier_stages():
    backward = [
        f"{source} -> {target}"
        for source, target in _graph().edges
        if target != "autoplan" and RANK[_stage(target)] > RANK[_stage(source)]
    ]
    assert not backward, "imports running back up the pipeline:\n" + "\n".join(backward)


def test_the_first_words_import_nothing_else_of_autoplan():
    vocabulary = {"autoplan.errors", "autoplan.units", "autoplan.mesh"}
    for module in vocabulary:
        imported = _imports(module, _modules()[module])
        assert imported <= vocabulary, (module, imported)


def test_no_private_name_crosses_modules():
    crossing = []
    for module, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("autoplan"):
                crossing += [f"{module}: {alias.name} from {node.module}" for alias in node.names if alias.name.startswith("_")]
    assert not crossing, crossing


@pytest.mark.parametrize("module", sorted(_modules()))
def test_modules_and_functions_stay_small(module):
    path = _modules()[module]
    source = path.read_text()
    assert len(source.splitlines()) <= MAX_MODULE_LINES, f"{module}: {len(source.splitlines())} lines"
    long = [
        f"{node.name}: {_code_lines(node)} lines"
        for node in ast.walk(ast.parse(source))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _code_lines(node) > MAX_FUNCTION_LINES
    ]
    assert not long, f"{module}: {long}"


def _code_lines(function: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines from `def` to the end, the docstring counted: a function a reader takes in whole."""
    return function.end_lineno - function.lineno + 1


def test_the_checker_sees_a_backward_import_inside_a_function(tmp_path):
    """The rules above would pass vacuously if _imports missed function-level imports."""
    module = tmp_path / "probe.py"
    module.write_text("def late():\n    from autoplan.report.text import format_report\n    return format_report\n")
    assert _imports("autoplan.trace.probe", module) == {"autoplan.report.text"}
