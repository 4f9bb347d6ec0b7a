"""The README's sample outputs and the commands that print them.

Each block of output the README shows follows a `<!-- sample: NAME · ... -->` line naming one of
`SAMPLES`. Run as a script, this module runs those commands on this machine, at the README's
100 columns, and writes what they print into the blocks (the lines a sample keeps, `...` where it
leaves some out), the marker line saying the machine and how long each took:

    python -m tests.readme_samples             # every sample (about 10 minutes on 2 cores)
    python -m tests.readme_samples qlora       # one
    python -m tests.readme_samples --check     # print what would change, write nothing

tests/test_docs.py checks that every `$ autoplan` block is marked, opens with its sample's command
and names the run that wrote it (running them is minutes: not a test's job), and how blocks are cut.
"""

from __future__ import annotations

import os
import platform
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
WIDTH = 100  # the README's code blocks are read at this width
ELIDED = "..."
MARKER = re.compile(r"^<!-- sample: (?P<name>[\w-]+)(?P<rest>[^\n]*)-->\n```\n(?P<block>.*?)```\n", re.S | re.M)


@dataclass(frozen=True)
class Sample:
    """One command the README shows the output of, and which of its lines it shows."""

    name: str
    command: tuple[str, ...]  # run from the repository root
    prompt: bool  # the block opens with the command as typed (`$ autoplan ...`); False: output only
    # (first line, first line after) pairs of regular expressions, each a run of lines the block keeps;
    # none: all of it. Runs are joined by `...`, and a `...` stands where a run leaves lines before it or after the last.
    runs: tuple[tuple[str, str | None], ...] = ()

    def typed(self) -> str:
        return "$ " + shlex.join(self.command)

    def shown(self, output: str) -> str:
        """The block the README shows for `output`: the prompt, then the runs of lines it keeps."""
        lines = [line.rstrip() for line in output.rstrip("\n").split("\n")]  # rich pads each line to the width
        kept = [self.typed()] if self.prompt else []
        kept += _cut(lines, self.runs) if self.runs else lines
        return "\n".join(kept) + "\n"


def _cut(lines: list[str], runs: tuple[tuple[str, str | None], ...]) -> list[str]:
    kept: list[str] = []
    position = 0
    for first, after in runs:
        start = next((i for i in range(position, len(lines)) if re.search(first, lines[i])), None)
        if start is None:
            raise ValueError(f"no line matches {first!r} after line {position}: the sample's runs need writing again")
        end = next((i for i in range(start + 1, len(lines)) if after and re.search(after, lines[i])), len(lines))
        if start > position:
            kept.append(ELIDED)
        kept += lines[start:end]
        position = end
    if position < len(lines):
        kept.append(ELIDED)
    return kept


SAMPLES = (
    Sample("qwen-fits", ("autoplan", "plan", "hf:qwen2.5-0.5b", "--budget", "22GB", "--device", "rtx-4090",
                         "--batch-size", "2", "--seq-len", "2048"),
           prompt=True),
    Sample("llama-1b-does-not-fit", ("autoplan", "plan", "hf:llama-3.2-1b", "--budget", "24GB", "--device", "rtx-4090"),
           prompt=True),
    Sample("llama-70b-counted", ("autoplan", "plan", "hf:llama-3-70b", "--budget", "80GB", "--device", "h100-80gb",
                                 "--seq-len", "4096"),
           prompt=True, runs=((r"^DOES NOT FIT", r"^what to change"), (r"^ ?\d+\. 8-bit", r"^8-bit optimizer|^note"))),
    Sample("qlora-example", (sys.executable, "examples/qlora.py"), prompt=False,
           runs=((r"^trainable", r"^training loop"),
                 (r"^ base_model\.model\.model\.layers\.", r"^(?! base_model)"),
                 (r"^predicted peak .* measured", r"^step 1:"))),
    Sample("ladder-8b", ("autoplan", "plan", "hf:llama-3-8b", "--budget", "24GB", "--device", "rtx-4090", "--ladder"),
           prompt=True,
           runs=((r"^the toolbox ladder", r"^[^ ━]"),)),
)
BY_NAME = {sample.name: sample for sample in SAMPLES}


def written_samples(text: str) -> dict[str, str]:
    """Each marked block of `text`, by its sample's name."""
    return {found["name"]: found["block"] for found in MARKER.finditer(text)}


def with_sample(text: str, name: str, block: str, note: str) -> str:
    """`text` with sample `name`'s block replaced by `block`, its marker line carrying `note`."""
    if name not in written_samples(text):
        raise ValueError(f"README.md has no '<!-- sample: {name} ... -->' block")
    def replace(found: re.Match[str]) -> str:
        return f"<!-- sample: {name} · {note} -->\n```\n{block}```\n" if found["name"] == name else found[0]
    return MARKER.sub(replace, text)


def run_sample(sample: Sample) -> tuple[str, float]:
    """What the sample's command prints (stdout, whatever its exit code: 3 is a verdict), and its wall seconds."""
    environment = dict(os.environ, COLUMNS=str(WIDTH), PYTHONPATH=str(ROOT))
    started = time.perf_counter()
    finished = subprocess.run(sample.command, cwd=ROOT, env=environment, capture_output=True, text=True)
    if finished.returncode not in (0, 3):
        raise RuntimeError(f"{' '.join(sample.command)} exited {finished.returncode}:\n{finished.stderr[-2000:]}")
    return finished.stdout, time.perf_counter() - started


def main(arguments: list[str]) -> int:
    from benchmarks.machine import describe_machine

    check = "--check" in arguments
    names = [a for a in arguments if a != "--check"] or list(BY_NAME)
    unknown = [name for name in names if name not in BY_NAME]
    if unknown:
        raise SystemExit(f"no such sample: {', '.join(unknown)}; the samples: {', '.join(BY_NAME)}")
    print(f"# {describe_machine(libraries=('transformers', 'bitsandbytes', 'peft'))}")
    text = README.read_text()
    for name in names:
        output, seconds = run_sample(BY_NAME[name])
        block = BY_NAME[name].shown(output)
        changed = written_samples(text).get(name) != block
        print(f"{name}: {seconds:.0f} s, {'changed' if changed else 'unchanged'}", flush=True)
        if check and changed:
            print(block)
        note = f"python -m tests.readme_samples {name} · {time.strftime('%Y-%m-%d')}, {seconds:.0f} s on {platform.node()}"
        text = with_sample(text, name, block, note)
    if not check:
        README.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
