"""Every line of tests/, bench/, docs/ and exercises/ fits in 120 characters, so a file reads without sideways
scrolling. The scripts and lib/ are held to the same limit, with their line budgets, by tests/test_budgets.py."""
import glob
import os

from bench.script_lines import MAX_LINE

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_no_python_line_is_over_120_characters():
    paths = [p for folder in ("tests", "bench", "docs", "exercises")
             for p in glob.glob(os.path.join(ROOT, folder, "*.py"))]
    assert len(paths) > 40  # the glob found the files, not an empty list
    long = [f"{os.path.relpath(p, ROOT)}:{i}: {len(line)} characters"
            for p in sorted(paths) for i, line in enumerate(open(p, encoding="utf-8").read().splitlines(), 1)
            if len(line) > MAX_LINE]
    assert long == [], "\n".join(long)
