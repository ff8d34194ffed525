"""Reading budgets: every script within its line budget, lib/ as a whole within its own, and no line of a script or
of lib/*.py over 120 characters. The table is bench/script_lines.py's BUDGETS; change a number there on purpose."""

import os

import pytest

from bench import script_lines
from tests.conftest import ROOT


def test_every_script_and_lib_within_its_line_budget():
    over = [(name, lines, budget) for name, lines, budget in script_lines.violations(ROOT) if ":" not in name]
    assert not over, "\n".join(f"{name} has {lines} lines, over its budget of {budget} (bench/script_lines.py)"
                               for name, lines, budget in over)


def test_every_script_in_the_table_exists():
    assert sorted(name for name in script_lines.BUDGETS if name != "lib/") == sorted(script_lines.SCRIPTS)


def test_onefile_train_has_no_line_over_120_characters():
    long = [(where, length) for where, length, _ in script_lines.violations(ROOT, {"onefile_train.py": 550})
            if where.startswith("onefile_train.py:")]
    assert not long, "\n".join(f"{where} is {length} characters long, over 120" for where, length in long)


def test_no_line_of_a_script_or_lib_over_120_characters():
    long = [(where, length) for where, length, _ in script_lines.violations(ROOT) if ":" in where]
    assert not long, "\n".join(f"{where} is {length} characters long, over {script_lines.MAX_LINE}"
                               for where, length in long)


def test_violations_names_a_script_over_budget_and_a_long_line(tmp_path):
    # A copy of a script one line over its budget, with one line of 121 characters: both must be reported.
    name = "judge_train_cuda.py"
    lines = [line[:120] for line in open(os.path.join(ROOT, name), encoding="utf-8").read().splitlines()]
    lines = lines[:script_lines.BUDGETS[name]] + ["x = 1"] * (script_lines.BUDGETS[name] + 1 - len(lines))
    lines[3] = "#" + "x" * 120
    (tmp_path / name).write_text("\n".join(lines) + "\n", encoding="utf-8")
    found = script_lines.violations(str(tmp_path), {name: script_lines.BUDGETS[name]})
    assert (name, script_lines.BUDGETS[name] + 1, script_lines.BUDGETS[name]) in found
    assert (f"{name}:4", 121, 120) in found
    # And a line of exactly 120 characters, at its budget, is fine.
    lines = lines[:-1]
    lines[3] = "#" + "x" * 119
    (tmp_path / name).write_text("\n".join(lines) + "\n", encoding="utf-8")
    assert [v for v in script_lines.violations(str(tmp_path), {name: script_lines.BUDGETS[name]})
            if v[0].startswith(name)] == []
