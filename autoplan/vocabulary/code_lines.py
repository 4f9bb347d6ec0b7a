"""Code the report prints for a person to paste, wrapped to fit a terminal and still valid Python.

A line longer than the width breaks after the commas of its outermost brackets, continued four
spaces deeper (Python joins lines inside brackets); an argument still too long breaks inside its
own brackets the same way. Strings and comprehensions are never broken, and a trailing comment
moves above the line.
"""

from __future__ import annotations

WIDTH = 88  # columns: an 80-column terminal shows the rest soft-wrapped, a 100-column one in full


def wrap_code(code: str, width: int = WIDTH) -> str:
    """`code` with every line over `width` columns broken inside its brackets."""
    return "\n".join(wrapped for line in code.split("\n") for wrapped in _wrap_line(line, width))


def _wrap_line(line: str, width: int) -> list[str]:
    if len(line) <= width:
        return [line]
    indent = line[: len(line) - len(line.lstrip())]
    body, comment = _split_comment(line.strip())
    above = [f"{indent}{comment}"] if comment else []
    return above + _wrap(body, indent, width)


def _wrap(body: str, indent: str, width: int) -> list[str]:
    """`body` (no comment) as lines that start with `indent`, broken after the commas of its first bracket."""
    if len(indent) + len(body) <= width:
        return [indent + body]
    opened, closed = _outer_brackets(body)
    arguments = _arguments(body[opened + 1 : closed]) if opened is not None and closed is not None else []
    if opened is None or not arguments or any(" for " in f" {argument} " for argument in arguments):
        return [indent + body]  # nothing to break inside (or a comprehension, read whole): left long
    head, tail = body[: opened + 1], body[closed:]
    deeper = indent + "    "
    lines = [indent + head]
    for argument in arguments:
        piece = argument + ","
        if len(lines) > 1 and len(lines[-1]) + 1 + len(piece) <= width:
            lines[-1] += " " + piece
        else:
            lines.extend(_wrap(piece, deeper, width))
    lines[-1] = lines[-1].removesuffix(",")
    if len(lines[-1]) + len(tail) <= width:
        lines[-1] += tail
    else:
        lines.append(indent + tail)
    return lines


def _code_chars(text: str):
    """(index, char, depth) of each character outside string literals; depth counts the brackets open before it."""
    depth, quote = 0, None
    for index, char in enumerate(text):
        if quote:
            quote = None if char == quote and text[index - 1] != "\\" else quote
        elif char in "\"'":
            quote = char
        else:
            yield index, char, depth
            depth += (char in "([{") - (char in ")]}")


def _split_comment(text: str) -> tuple[str, str]:
    """(code, "# comment") of a line, the comment found outside strings."""
    index = next((index for index, char, _ in _code_chars(text) if char == "#"), None)
    return (text, "") if index is None else (text[:index].rstrip(), text[index:])


def _outer_brackets(text: str) -> tuple[int | None, int | None]:
    """Where the first top-level bracket opens and where it closes (outside strings)."""
    opened = None
    for index, char, depth in _code_chars(text):
        if char in "([{" and depth == 0 and opened is None:
            opened = index
        elif char in ")]}" and depth == 1 and opened is not None:
            return opened, index
    return None, None


def _arguments(inner: str) -> list[str]:
    """The comma-separated parts of a bracket's content, at its own depth."""
    cuts = [index for index, char, depth in _code_chars(inner) if char == "," and depth == 0]
    parts = [inner[start + 1 : end] for start, end in zip([-1, *cuts], [*cuts, len(inner)])]
    return [part.strip() for part in parts if part.strip()]
