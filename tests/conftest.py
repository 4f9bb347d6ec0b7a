"""Test session settings: under pytest-xdist each worker runs torch on one thread, so the workers
(one per core) do not oversubscribe the machine; and `--dist loadfile` runs the files that share a
per-process cache on one worker, so the cache is filled once per run instead of once per worker; and
a report is rendered at its own width (COLUMNS unset), as in a plain `python` process: xdist's workers
inherit COLUMNS=80, which wrapped `plan.report()` where `-n 0` did not."""

import os

import pytest
import torch

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)
os.environ.pop("COLUMNS", None)  # a test that reads a width sets its own (monkeypatch.setenv)

# Files that read one per-process cache: each group runs on one worker. tests/families.py's
# `planned` (a dozen Hugging Face plans, minutes of CPU) serves both of these.
SHARED_CACHE_FILES = {
    "tests/hf/test_models.py": "families.planned",
    "tests/inputs/test_loop.py": "families.planned",
}


@pytest.hookimpl(optionalhook=True)  # an xdist hook: without xdist (-p no:xdist) there is nothing to schedule
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile`, with the files of SHARED_CACHE_FILES scheduled as one unit.

    (`--dist loadgroup` with xdist_group marks would say the same, but xdist 3.8 cannot rename the
    tests of a group under pytest 9, so there every test went to a worker of its own.)"""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class SharedCacheFileScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = super()._split_scope(nodeid)
            return SHARED_CACHE_FILES.get(path, path)

    return SharedCacheFileScheduling(config, log)


# Folders whose every test runs the whole pipeline (or a process): marked slow without a mark each.
WHOLE_PIPELINE_FOLDERS = ("end_to_end", "hf")


def pytest_collection_modifyitems(config, items):
    """Every test under WHOLE_PIPELINE_FOLDERS is `slow` (the README's test command and .ci/run leave them out with `-m 'not slow'`; a plain `python -m pytest` runs them)."""
    for item in items:
        if item.path.parent.name in WHOLE_PIPELINE_FOLDERS and item.path.parent.parent.name == "tests":
            item.add_marker(pytest.mark.slow)
