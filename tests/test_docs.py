"""The docs' option tables are the options' schema: docs/api.md's from `autoplan.inputs.options`, docs/command-line.md's
from the flags `autoplan plan` takes (`autoplan.cli.flags`). Written anew by `python -m tests.test_docs`."""

from __future__ import annotations

import re
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent.parent / "docs"
START, END = "<!-- table: made from {} (python -m tests.test_docs writes it) -->\n", "<!-- end of table -->\n"


def _tables() -> dict[str, tuple[str, str]]:
    """Per docs file: what makes its table, and the table."""
    from autoplan.cli.app import plan_command
    from autoplan.cli.flags import options_table
    from autoplan.inputs.options import api_table

    return {"api.md": ("autoplan.inputs.options.PlanOptions", api_table()),
            "command-line.md": ("autoplan.cli.flags for autoplan plan", options_table(plan_command))}


def _between(text: str, source: str) -> re.Match | None:
    return re.search(re.escape(START.format(source)) + r"(.*?)" + re.escape(END), text, re.DOTALL)


def test_the_docs_tables_are_the_schema_s():
    for name, (source, table) in _tables().items():
        found = _between((DOCS / name).read_text(), source)
        assert found is not None, f"docs/{name} has no table made from {source}"
        assert found[1] == table, f"docs/{name}'s table is not {source}'s: python -m tests.test_docs writes it anew"


def write() -> None:
    for name, (source, table) in _tables().items():
        path = DOCS / name
        text = path.read_text()
        found = _between(text, source)
        if found is None:
            sys.exit(f"docs/{name}: no {START.format(source)!r} line to write under")
        path.write_text(text[:found.start(1)] + table + text[found.end(1):])


if __name__ == "__main__":
    write()
