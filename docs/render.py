"""Render every generated figure block in README.md and docs/*.md from its source.

    python docs/render.py            # rewrite every block from its source
    python docs/render.py --check    # render in memory; name page and line of every block that differs

A figure block is a table or number that comes from the code or from a measurement:

    <!-- figures: bench.faults.render bench/results/faults.json -->
    ...rendered markdown...
    <!-- /figures -->

or, for one number inside a sentence, inline: `... peaked at <!-- figures: SOURCE -->622 MiB<!-- /figures -->.`
The opening comment names its SOURCE: a function, importable from the repository root, and the
arguments it is called with (strings, split on spaces). The function returns the block's markdown.
For a measured table the argument is a committed JSON file under bench/results/, and the rendering
names the device, torch version and date recorded in it (bench.machine.caption). For an estimator
table the function computes the figures on the meta device, in seconds. A transcript of real runs
(docs.transcripts.render NAME) trains for seconds, and only when the code it ran has changed.
"""

import argparse
import importlib
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OPEN = re.compile(r"^<!-- figures: (?P<source>.+?) -->\s*$")
CLOSE = "<!-- /figures -->"
# A number in a sentence (not one quoted in `code`): <!-- figures: SOURCE -->622 MiB<!-- /figures -->
INLINE = re.compile(r"(?<!`)<!-- figures: (?P<source>[^>]+?) -->(?P<old>.*?)<!-- /figures -->")


def pages():
    """README.md and every docs/*.md, as paths relative to the repository root."""
    docs = sorted(f"docs/{name}" for name in os.listdir(os.path.join(ROOT, "docs")) if name.endswith(".md"))
    return ["README.md", *docs]


def call(source):
    """Run one block's SOURCE ("module.function arg ...") and return its markdown, stripped."""
    target, *args = source.split()
    module, _, function = target.rpartition(".")
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    return getattr(importlib.import_module(module), function)(*args).strip("\n")


def blocks(text):
    """Yield (opening line number, closing line number, source) for every block of a page (0-based)."""
    lines = text.split("\n")
    start = source = None
    for i, line in enumerate(lines):
        m = None if INLINE.search(line) else OPEN.match(line)
        if m:
            if start is not None:
                raise ValueError(f"line {i + 1}: a figure block opens inside the block opened at line {start + 1}")
            start, source = i, m.group("source")
        elif line.strip() == CLOSE:
            if start is None:
                raise ValueError(f"line {i + 1}: {CLOSE} without an opening block")
            yield start, i, source
            start = None
    if start is not None:
        raise ValueError(f"line {start + 1}: figure block never closed with {CLOSE}")


def render_page(text):
    """The page with every block replaced by its rendering; returns (new text, [(line, source, old, new)])."""
    lines = text.split("\n")
    out, last, changed = [], 0, []
    for i, line in enumerate(lines):  # numbers in sentences first: the line numbers are the page's
        lines[i] = INLINE.sub(lambda m: inline(m, i, changed), line)
    for start, end, source in blocks(text):
        try:
            new = call(source)
        except Exception as err:  # name the block whose source failed, then the cause
            raise RuntimeError(f"line {start + 1}: figure block {source} failed to render: {err!r}") from err
        old = "\n".join(lines[start + 1:end])
        if old != new:
            changed.append((start + 1, source, old, new))
        out += lines[last:start + 1] + [new]
        last = end
    out += lines[last:]
    return "\n".join(out), sorted(changed)


def inline(m, i, changed):
    """One inline block, <!-- figures: SOURCE -->NUMBER<!-- /figures --> inside a sentence, rendered again."""
    try:
        new = call(m.group("source"))
    except Exception as err:
        raise RuntimeError(f"line {i + 1}: figure {m.group('source')} failed to render: {err!r}") from err
    if "\n" in new:
        raise ValueError(f"line {i + 1}: inline figure {m.group('source')} renders more than one line")
    if new != m.group("old"):
        changed.append((i + 1, m.group("source"), m.group("old"), new))
    return f"<!-- figures: {m.group('source')} -->{new}{CLOSE}"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="render in memory and fail where a block differs")
    p.add_argument("pages", nargs="*", help="pages to render (default: README.md and docs/*.md)")
    args = p.parse_args(argv)
    differ = 0
    for page in args.pages or pages():
        path = os.path.join(ROOT, page)
        with open(path, encoding="utf-8") as f:
            text = f.read()
        try:
            new, changed = render_page(text)
        except (RuntimeError, ValueError) as err:
            print(f"{page}:{err}", file=sys.stderr)
            return 2
        for line, source, _, _ in changed:
            print(f"{page}:{line}: figure block differs from its source ({source})")
        differ += len(changed)
        if changed and not args.check:
            with open(path, "w", encoding="utf-8") as f:
                f.write(new)
    if not args.check and "docs.transcripts" in sys.modules:
        sys.modules["docs.transcripts"].write_cache()  # the transcripts run now, kept with their code's hash
    if args.check and differ:
        print(f"{differ} block(s) differ; run `python docs/render.py` to rewrite them", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
