"""Every line of the scripts, lib/, tests/, bench/, docs/ and exercises/ fits in 120 characters, so a file reads
without sideways scrolling. (onefile_train.py is held to its own reading budget.)"""
import glob
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIMIT = 120


def test_no_python_line_is_over_120_characters():
    paths = [p for p in glob.glob(os.path.join(ROOT, "*.py")) if os.path.basename(p) != "onefile_train.py"]
    for folder in ("lib", "tests", "bench", "docs", "exercises"):
        paths += glob.glob(os.path.join(ROOT, folder, "*.py"))
    assert len(paths) > 40  # the glob found the files, not an empty list
    long = [f"{os.path.relpath(p, ROOT)}:{i}: {len(line)} characters"
            for p in sorted(paths) for i, line in enumerate(open(p, encoding="utf-8").read().splitlines(), 1)
            if len(line) > LIMIT]
    assert long == [], "\n".join(long)
