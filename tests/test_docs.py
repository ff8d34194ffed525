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
    shell = {}  # NAME="..." set earlier in a code block (a transcript's $TINY), put into later commands
    for n, line in enumerate(text.split("\n"), 1):
        if line.lstrip().startswith("```"):
            in_fence, shell = not in_fence, {}
            continue
        line = line.removeprefix("$ ")  # a transcript's command line
        if in_fence and re.match(r'^\w+="[^"]*"$', line):
            name, _, value = line.partition("=")
            shell["$" + name] = value.strip('"')
            continue
        for name, value in shell.items():
            line = line.replace(name, value)
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


def anchors(text):
    """The anchors a Markdown text has on GitHub: each heading's slug (lower case, punctuation dropped, spaces to
    hyphens, a repeated one numbered -1, -2, ...; headings inside code fences are not headings), and <a id=...>."""
    found, seen, fenced = set(), {}, False
    for line in text.split("\n"):
        if line.startswith("```"):
            fenced = not fenced
        heading = None if fenced else re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if heading:
            slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
            found.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
            seen[slug] = seen.get(slug, 0) + 1
        found.update(re.findall(r"<a (?:id|name)=\"([^\"]+)\"", line))
    return found


def test_anchors_follow_github_slugs():
    text = ("# A: b/c.py\n## The scripts' peaks\n```\n# not a heading\n```\n## Two nodes\n## Two nodes\n"
            "<a id=\"x\"></a>\n")
    assert anchors(text) == {"a-bcpy", "the-scripts-peaks", "two-nodes", "two-nodes-1", "x"}


@pytest.mark.parametrize("page", PAGES)
def test_references_resolve(page):
    text = read(page)
    base = os.path.dirname(os.path.join(ROOT, page))
    problems = []
    for n, line in enumerate(text.split("\n"), 1):
        for target in LINK.findall(line):
            if re.match(r"[a-z]+:", target):
                continue
            if target.startswith("#"):
                if target[1:] not in anchors(text):
                    problems.append(f"{page}:{n}: link {target}: no such heading or anchor on this page")
                continue
            path = os.path.normpath(os.path.join(base, target.split("#")[0]))
            if not os.path.exists(path):
                problems.append(f"{page}:{n}: link {target} does not resolve")
            elif "#" in target and path.endswith(".md") and target.split("#", 1)[1] not in anchors(
                    read(os.path.relpath(path, ROOT))):
                problems.append(f"{page}:{n}: link {target}: no such heading or anchor in "
                                f"{os.path.relpath(path, ROOT)}")
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


# --- quoted program output -----------------------------------------------------------------------

# A quote of what a program prints: one of its message openings, then words.
MESSAGE = re.compile(r"^(?:(?:error|warning|interrupted|data|model):|--[a-z][\w-]*:|terminated \(SIGTERM\):"
                     r"|saved )\s*\S")
# What a page writes for a value the program fills in: N, OUT, PATH, numbers, paths, file names, flags, '...'.
# A message is often put together from parts ("error: " + the message, "interrupted" + ": " + where): ": " splits.
PLACEHOLDER = re.compile(r"\.\.\.|…|: |\bnan\b|\binf\b|\b[A-Z][A-Z_]*\b|\S*/\S*|\S+\.\w+|\d[\d,.]*|--[a-z][\w-]*"
                         r"|\bstep-\d+")
FRAGMENT = 12  # literal fragments shorter than this are not checked (a word or two could be anywhere)


@functools.lru_cache(maxsize=None)
def source_strings():
    """Every string literal of the repository's code (scripts, lib/, bench/), an f-string's holes as NUL."""
    import ast
    found = []
    for path in glob.glob(os.path.join(ROOT, "*.py")) + glob.glob(os.path.join(ROOT, "lib", "*.py")) + \
            glob.glob(os.path.join(ROOT, "bench", "*.py")):
        for node in ast.walk(ast.parse(read(os.path.relpath(path, ROOT)))):
            if isinstance(node, ast.JoinedStr):
                found.append("".join(v.value if isinstance(v, ast.Constant) else "\0" for v in node.values))
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                found.append(node.value)
    return "\n".join(found)


def quotes(text):
    """(line, quote) for every quoted message: an inline code span, or a line of a code block, that opens
    like program output. Figure blocks are left out: they are rendered from real output."""
    lines = text.split("\n")
    inside = {i for start, end, _ in render.blocks(text) for i in range(start, end + 1)}
    found, fence, prose = [], False, []
    for i, line in enumerate(lines):
        if line.lstrip().startswith("```"):
            fence = not fence
            continue
        if i in inside:
            continue
        if fence or (line.startswith("    ") and not line.lstrip().startswith(("-", "*", "|"))):
            if MESSAGE.match(line.strip()):
                found.append((i + 1, line.strip()))
        else:
            prose.append((i + 1, line))
    joined = "\n".join(line for _, line in prose)
    numbers = [n for n, _ in prose]
    for m in re.finditer(r"`([^`]+)`", joined):
        quote = " ".join(m.group(1).split())
        if MESSAGE.match(quote) and len(quote.split()) > 2:
            found.append((numbers[joined[:m.start()].count("\n")], quote))
    return found


def missing_fragments(quote):
    """The literal fragments of a quote (placeholders taken out) that no string of the code holds."""
    return [f for f in (f.strip(" ;:,()'\"") for f in PLACEHOLDER.split(quote))
            if len(f) >= FRAGMENT and f not in source_strings()]


def test_pages_quote_messages():
    # The pages quote few messages (the programs print them; a page teaches the idea), but the check must reach
    # some: a detector that found none would pass every page.
    assert sum(len(quotes(read(page))) for page in PAGES) >= 2


@pytest.mark.parametrize("page", PAGES)
def test_quoted_messages_are_what_the_code_prints(page):
    problems = [f"{page}:{n}: {q[:100]}: not in the code: {missing_fragments(q)}"
                for n, q in quotes(read(page)) if missing_fragments(q)]
    assert not problems, "a page quotes output the code does not print:\n" + "\n".join(problems)


def test_a_made_up_quote_is_caught():
    page = "Resuming prints `--resume: continuing from the last good checkpoint in OUT` and\n\n" \
           "    error: --resume: OUT/training_state.pt is damaged (truncated); it cannot be mended\n"
    found = quotes(page)
    assert [n for n, _ in found] == [3, 1]
    assert missing_fragments(found[0][1]) == ["is damaged (truncated); it cannot be mended"]
    assert missing_fragments(found[1][1]) == ["continuing from the last good checkpoint in"]
    assert missing_fragments("error: the loss became nan at step N; stopped after the update") == \
        ["stopped after the update"]
    assert not missing_fragments("--resume: skipping the checkpoint OUT/checkpoints/step-000006: ...")


# --- measured numbers in sentences ----------------------------------------------------------------

# A number with a unit of time, memory, rate or quality, or a ratio such as 1.45x: a computed or
# measured figure, so it sits in a figure block (inline ones too: docs/render.py), or it drifts.
FIGURE = re.compile(r"(?<![\w.-])\d[\d,]*(?:\.\d+)?\s*(?:(?:GiB|MiB|KiB|GB|MB|KB|TB|tokens/s|tok/s|samples/s|it/s"
                    r"|seconds?|s|ms|min|minutes|hours|h)\b|(?<=\d)[x×](?!\w))"
                    r"|\b(?:MAE|r =|MRR@10) ?(?:of |is )?\d+\.\d+")
# Arithmetic a page works by hand, not a measurement: (page, the exact phrase, why).
BY_HAND = [
    ("docs/adam8bit_explained.md", "3 GB", "1.5B parameters x 2 bytes of 8-bit state: arithmetic"),
    ("docs/adam8bit_explained.md", "12 GB", "1.5B parameters x 8 bytes of fp32 AdamW state: arithmetic"),
    ("docs/adam8bit_explained.md", "1 MiB", "the size of a chunk the code is written with (a constant)"),
    ("docs/big_vocab_loss.md", "128 KiB", "glibc's documented starting mmap threshold"),
    ("docs/big_vocab_loss.md", "32 MiB", "glibc's documented ceiling of its mmap threshold; an earlier chunk budget"),
    ("docs/big_vocab_loss.md", "4 KiB", "the page size"),
    ("docs/big_vocab_loss.md", "24 GB", "the figure the Cut Cross-Entropy paper reports, cited"),
    ("docs/big_vocab_loss.md", "1 MB", "the figure the Cut Cross-Entropy paper reports, cited"),
    ("docs/fsdp2_explained.md", "23.2 GiB", "1,557,611,200 parameters x 16 bytes, worked on the page"),
    ("docs/fsdp2_explained.md", "313 MiB", "the root unit's parameters x 4 bytes, listed on the page"),
    ("docs/fsdp2_explained.md", "1.5x", "3P against 2P of traffic, worked on the page"),
    ("docs/fsdp2_explained.md", "24 GB", "a GPU's memory size, not a figure of this repository"),
    ("docs/fsdp2_explained.md", "307 MiB", "50,257 x 1,600 x 4 bytes, worked on the page"),
    ("docs/fsdp2_explained.md", "6.2 GB", "1.56B parameters x 4 bytes"),
    ("docs/judge_mps_vs_cuda.md", "128 KiB", "judge_train_cuda.py's heap threshold (cpu_heap_threshold), a setting"),
    ("docs/memory_optimization.md", "22 MiB",
     "B_eff (2 + k) x vocabulary x 8 bytes for BERT-base at 32, worked on the page"),
    ("docs/pretraining_data.md", "1,600 MB", "the sizes bench/prepare.py is told to prepare: its inputs"),
    ("docs/pretraining_data.md", "8 MB", "the size of the files bench/prepare.py writes: its input"),
    ("docs/qlora_explained.md", "23 GiB", "1.56 billion parameters x 16 bytes, worked on the page"),
    ("docs/qlora_explained.md", "32 MiB", "glibc's documented ceiling of its mmap threshold"),
    ("docs/splade_explained.md", "5.94 GiB", "17,408 tokens x 30,522 x 12 bytes, worked on the page"),
    ("docs/wpo_sgm_memory.md", "36 GB", "K = 1000 x 3072^2 x 4 bytes, as the original README prints it"),
    ("docs/wpo_sgm_memory.md", "36.00 GB", "the original README's own output, quoted"),
    ("docs/wpo_sgm_memory.md", "37.7 GB", "1000 x 3072^2 x 4 bytes, worked on the page"),
    ("docs/wpo_sgm_memory.md", "35.2 GiB", "1000 x 3072^2 x 4 bytes, worked on the page"),
    ("docs/wpo_sgm_memory.md", "3.4 GiB", "307 M parameters x 12 bytes (weights and AdamW state; the update)"),
    ("docs/wpo_sgm_memory.md", "32 MiB", "glibc's documented ceiling of its mmap threshold"),
    ("docs/wpo_sgm_memory.md", "128 KiB", "the script's heap threshold, a setting"),
]


def prose(page):
    """The page without its figure blocks."""
    text = read(page)
    inside = {i for start, end, _ in render.blocks(text) for i in range(start, end + 1)}
    return "\n".join(line for i, line in enumerate(text.split("\n")) if i not in inside)


def figures_in_sentences(page, text):
    """(line, figure) for every figure outside a block: not in a figure block, an inline block, a code block
    or an indented one, and not a phrase of BY_HAND."""
    inside = {i for start, end, _ in render.blocks(text) for i in range(start, end + 1)}
    allowed = [phrase for where, phrase, _ in BY_HAND if where == page]
    found, fence = [], False
    for i, line in enumerate(text.split("\n")):
        if line.lstrip().startswith("```"):
            fence = not fence
            continue
        if i in inside or fence or line.startswith("    ") or line.startswith("|"):
            continue
        line = render.INLINE.sub("", line)
        for phrase in allowed:
            line = line.replace(phrase, "")
        found += [(i + 1, m.group(0)) for m in FIGURE.finditer(line)]
    return found


@pytest.mark.parametrize("page", PAGES)
def test_figures_in_sentences_sit_in_blocks(page):
    found = figures_in_sentences(page, read(page))
    assert not found, "render these from their source (an inline block), or delete them:\n" + "\n".join(
        f"{page}:{n}: {figure}" for n, figure in found)


def test_a_figure_in_a_sentence_is_caught_and_an_inline_block_is_not():
    text = "It took 1.45x as long (12 s, 622 MiB, MAE 0.05), on 4 x 1024 tokens at 2 bytes a parameter.\n" \
           "The peak: <!-- figures: docs.figures.value bench/results/x.json a -->622 MiB<!-- /figures -->.\n"
    assert [f for _, f in figures_in_sentences("docs/x.md", text)] == ["1.45x", "12 s", "622 MiB", "MAE 0.05"]
    # Each allowance is still used: its phrase is in its page's prose (a phrase left only inside a block, or gone,
    # would let the same figure back into a sentence unchecked).
    assert [phrase for page, phrase, why in BY_HAND if not (page in PAGES and phrase in prose(page) and why)] == []


def test_an_inline_block_is_rendered_and_checked(tmp_path, monkeypatch):
    json_path = tmp_path / "x.json"
    json_path.write_text('{"run": {"peak_mib": 621.6}}')
    source = f"docs.figures.value {json_path} run.peak_mib {{:.0f}}_MiB"
    line = f"The peak: <!-- figures: {source} -->600 MiB<!-- /figures -->."
    new, changed = render.render_page(line)
    assert changed == [(1, source, "600 MiB", "622 MiB")]
    assert new == line.replace("600 MiB", "622 MiB") and render.render_page(new)[1] == []


# --- transcripts of real runs ----------------------------------------------------------------------

def test_every_transcript_is_on_a_page_and_keeps_no_timing_or_path():
    from docs import transcripts
    sources = {source for page in PAGES for _, _, source in render.blocks(read(page))}
    assert {f"docs.transcripts.render {name}" for name in transcripts.SCENARIOS} <= sources
    printed = ["model: 2 layers",
               "step     3/6 | loss 10.4273 | lr 2.67e-04 |   192 tok/s | mem 402.86 MiB | ETA 0m00s",
               "data: 5,420,416 train tokens, /root/.cache/byhand/data/stdlib", "^C", "real\t0m1.2s",
               "interrupted: saved step 4 to OUT; continue with --resume (or --auto-resume)"]
    assert transcripts.tidy("\n".join(printed)) == [
        "...", "step     3/6 | loss 10.4273 | ...", "...", "^C", "...", printed[-1]]
    assert transcripts.stable("step 3/6 | loss 10.4273 | ...") == "step 3/6 | loss X | ..."
