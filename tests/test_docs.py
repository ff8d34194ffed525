"""The docs are tested like code: README.md and every docs/*.md page, read against the repository.

- every figure block equals what its source renders now (docs/render.py), and a changed digit
  inside any block is caught; a table of bytes or rates outside a block is refused;
- every command in a code block parses: the script exists and its own argparse parser accepts
  the arguments (so every --flag is in its --help, and required arguments are there);
- every relative link, every `path:line` and every `lib/module.name` reference resolves;
- the README's script table lists exactly the top-level scripts, and its flag table is the block
  rendered from their parsers;
- no page, code comment or test cites issue numbers or what hardware was "lent" to the work.
Nothing trains: the blocks' sources are estimators on the meta device and committed bench JSON.
"""

import functools
import glob
import importlib
import os
import re
import shlex
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from docs import figures, render  # noqa: E402

PAGES = render.pages()
CALL = render.call  # the real one; tests swap in a cached copy


def read(page):
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        return f.read()


@functools.lru_cache(maxsize=None)
def rendered(source):
    return CALL(source)


@pytest.fixture
def cached_render(monkeypatch):
    """render.call with each source rendered once per test session."""
    monkeypatch.setattr(render, "call", rendered)
    return render


# --- figure blocks -------------------------------------------------------------------------------

def test_there_are_figure_blocks():
    n = sum(1 for page in PAGES for _ in render.blocks(read(page)))
    assert n >= 10, f"only {n} figure blocks in README.md and docs/"


@pytest.mark.parametrize("page", PAGES)
def test_blocks_equal_their_rendering(page, cached_render):
    _, changed = cached_render.render_page(read(page))
    assert not changed, "\n".join(f"{page}:{line}: block differs from its source {source}; run python docs/render.py"
                                  for line, source, _, _ in changed)


@pytest.mark.parametrize("page", [p for p in PAGES if any(True for _ in render.blocks(read(p)))])
def test_a_changed_digit_in_any_block_is_caught(page, cached_render):
    """Change one digit inside each block in turn (in memory): the check must name that block."""
    text = read(page)
    lines = text.split("\n")
    stale = {c[0] for c in cached_render.render_page(text)[1]}  # reported by the test above already
    for start, end, source in render.blocks(text):
        for i in range(start + 1, end):
            m = re.search(r"\d", lines[i])
            if m:
                digit = m.group()
                mutated = lines[:i] + [lines[i][:m.start()] + str((int(digit) + 1) % 10)
                                       + lines[i][m.end():]] + lines[i + 1:]
                _, changed = cached_render.render_page("\n".join(mutated))
                assert {c[0] for c in changed} == stale | {start + 1}, f"{page}:{i + 1}: a changed digit went unnoticed"
                break
        else:
            pytest.fail(f"{page}:{start + 1}: block {source} holds no digit to change; is it a figure?")


def test_the_check_command_fails_on_a_changed_block(tmp_path, monkeypatch, cached_render, capsys):
    page = next(p for p in PAGES if any(True for _ in render.blocks(read(p))))
    text = read(page)
    start, end, _ = next(render.blocks(text))
    lines = text.split("\n")
    i = next(j for j in range(start + 1, end) if re.search(r"\d", lines[j]))
    lines[i] = re.sub(r"\d", lambda m: str((int(m.group()) + 1) % 10), lines[i], count=1)
    (tmp_path / "docs").mkdir()
    (tmp_path / page).write_text("\n".join(lines), encoding="utf-8")
    monkeypatch.setattr(render, "ROOT", str(tmp_path))
    assert render.main(["--check", page]) == 1
    assert f"{page}:{start + 1}:" in capsys.readouterr().out


MEASURE = re.compile(r"\d[\d,.]*\s*(GiB|MiB|KiB|GB/s|tok/s|tokens/s)\b")


@pytest.mark.parametrize("page", PAGES)
def test_tables_of_memory_and_speed_sit_in_blocks(page):
    """A table row that gives bytes or a rate is a computed or measured figure: it must be rendered."""
    text = read(page)
    inside = {i for start, end, _ in render.blocks(text) for i in range(start, end + 1)}
    rows = [f"{page}:{i + 1}: {line[:100]}" for i, line in enumerate(text.split("\n"))
            if i not in inside and line.startswith("|") and MEASURE.search(line)]
    assert not rows, "put these tables in a figure block rendered from their source:\n" + "\n".join(rows)


# --- commands ------------------------------------------------------------------------------------

SCRIPT = re.compile(r"^(?:[\w./-]+\.py)$")


def commands(text):
    """(line number, argv after the script, script) for every `python X.py ...`, `python -m X ...` or
    `torchrun ... X.py ...` in a fenced code block or an inline code span."""
    found = []
    in_fence = False
    for n, line in enumerate(text.split("\n"), 1):
        if line.lstrip().startswith("```"):
            in_fence = not in_fence
            continue
        pieces = [line] if in_fence else re.findall(r"`([^`]+)`", line)
        for piece in pieces:
            for part in re.split(r"&&|\|\||;|\|", piece):
                try:
                    words = shlex.split(part, comments=True)
                except ValueError:
                    continue
                while words and (words[0] in ("nice", "-n", "time", "env") or words[0].isdigit() or "=" in words[0]):
                    words = words[1:]
                # usage notation: [--flag VALUE] is an optional flag, written out here without its brackets
                words = [w.lstrip("[").rstrip("]") for w in words if w not in ("[", "]", "...]")]
                if not words or words[0] not in ("python", "python3", "torchrun"):
                    continue
                script, rest = None, words[1:]
                if words[0] == "torchrun":
                    for k, w in enumerate(rest):
                        if w.endswith(".py"):
                            script, rest = w, rest[k + 1:]
                            break
                        if w == "-m" and k + 1 < len(rest):
                            script, rest = rest[k + 1].replace(".", "/") + ".py", rest[k + 2:]
                            break
                elif rest and rest[0] == "-m" and len(rest) > 1:
                    if rest[1].split(".")[0] in ("pytest", "pip", "torch", "venv"):
                        continue  # not the repository's
                    script, rest = rest[1].replace(".", "/") + ".py", rest[2:]
                elif rest and SCRIPT.match(rest[0]):
                    script, rest = rest[0], rest[1:]
                if script is None or "<" in script:
                    continue  # no script, or a placeholder such as scripts.<name>
                if script.startswith("scripts/"):
                    script = script[len("scripts/"):]
                found.append((n, script, rest))
    return found


def all_commands():
    return [(page, n, script, argv) for page in PAGES for n, script, argv in commands(read(page))]


@functools.lru_cache(maxsize=None)
def parser_for(script):
    return figures.script_parser(script)


def test_pages_hold_commands():
    assert len(all_commands()) >= 30


@pytest.mark.parametrize("page", PAGES)
def test_every_command_parses(page):
    problems = []
    for n, script, argv in commands(read(page)):
        if not os.path.isfile(os.path.join(ROOT, script)):
            problems.append(f"{page}:{n}: {script} does not exist")
            continue
        if "..." in argv or any(w in ("-h", "--help") for w in argv):
            argv = [w for w in argv if w.startswith("--") and w != "..."]
            unknown = [w.split("=")[0] for w in argv if w.split("=")[0] not in figures.options(parser_for(script))]
            if unknown:
                problems.append(f"{page}:{n}: {script} has no {', '.join(unknown)} in its --help")
            continue
        message = figures.parse(parser_for(script), argv)
        if message:
            problems.append(f"{page}:{n}: python {script} {shlex.join(argv)}: {message}")
    assert not problems, "\n".join(problems)


# --- references ----------------------------------------------------------------------------------

LINK = re.compile(r"\]\(([^)\s]+)\)")
PATH_LINE = re.compile(r"\b((?:[\w-]+/)*[\w-]+\.py):(\d+)\b")
LIB_NAME = re.compile(r"\b((?:lib|bench|docs)/\w+)\.([A-Za-z_]\w*)\b")


@pytest.mark.parametrize("page", PAGES)
def test_references_resolve(page):
    text = read(page)
    base = os.path.dirname(os.path.join(ROOT, page))
    problems = []
    for n, line in enumerate(text.split("\n"), 1):
        for target in LINK.findall(line):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            path = os.path.normpath(os.path.join(base, target.split("#")[0]))
            if not os.path.exists(path):
                problems.append(f"{page}:{n}: link {target} does not resolve")
        for path, number in PATH_LINE.findall(line):
            full = os.path.join(ROOT, path)
            if not os.path.isfile(full):
                problems.append(f"{page}:{n}: {path}:{number}: no such file")
            elif int(number) > len(read(path).split("\n")):
                problems.append(f"{page}:{n}: {path}:{number}: the file is shorter")
        for module, name in LIB_NAME.findall(line):
            if name in ("py", "md", "json", "jsonl"):
                continue
            if not os.path.isfile(os.path.join(ROOT, module + ".py")):
                problems.append(f"{page}:{n}: {module}.py does not exist")
                continue
            mod = importlib.import_module(module.replace("/", "."))
            if not hasattr(mod, name):
                problems.append(f"{page}:{n}: {module}.py has no {name}")
    assert not problems, "\n".join(problems)


# --- the README's tables -------------------------------------------------------------------------

def test_readme_script_table_lists_exactly_the_scripts():
    text = read("README.md")
    table = re.search(r"## The scripts\n(.*?)\n\n", text, re.S).group(1)
    listed = set(re.findall(r"^\| `(\w+\.py)` \|", table, re.M))
    scripts = {os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "*.py"))
               if "def main(" in read(os.path.basename(p))}
    assert listed == scripts
    assert [name + ".py" for name, _ in figures.SCRIPTS if name + ".py" in listed] == \
        re.findall(r"^\| `(\w+\.py)` \|", table, re.M), "figures.SCRIPTS and the README list the scripts in one order"


def test_readme_flag_table_is_rendered_from_the_parsers():
    sources = [source for _, _, source in render.blocks(read("README.md"))]
    assert "docs.figures.flag_table" in " ".join(sources)
    assert "docs.figures.kept_names" in " ".join(sources)
    # And the table says what the parsers say, whatever the block holds: spot-check both ways.
    table = rendered(next(s for s in sources if s.startswith("docs.figures.flag_table")))
    header = table.split("\n")[0].split(" | ")
    for row in table.split("\n")[2:]:
        cells = [c.strip() for c in row.strip("|").split("|")]
        flag = cells[0].strip("`")
        for (name, _), cell in zip(figures.SCRIPTS, cells[1:]):
            assert (flag in figures.options(parser_for(name + ".py"))) == (cell == "✓"), (flag, name, header)


# --- no issue numbers ----------------------------------------------------------------------------

CITATION = re.compile(r"\bissues?\s*#?\d+|\bthe issue\b|\bthe issue's\b|\bwas lent\b|\bnot lent\b|\blent (?:to|GPU)\b",
                      re.I)


def repository_texts():
    paths = PAGES + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "**", "*.py"), recursive=True)
                           if "/out/" not in p and "/.git/" not in p)
    return paths


def test_nothing_cites_issue_numbers():
    problems = []
    for path in repository_texts():
        for n, line in enumerate(read(path).split("\n"), 1):
            if CITATION.search(line):
                problems.append(f"{path}:{n}: {line.strip()}")
    assert not problems, "cite what was measured, not an issue:\n" + "\n".join(problems)
