"""Reading measures for the ten scripts, printed as JSON: lines, the longest function,
and how many code lines are the technique rather than bookkeeping.

    python bench/script_lines.py                 # this checkout
    python bench/script_lines.py /tmp/before     # another checkout, e.g. `git archive 7ae2391 | tar -x -C /tmp/before`

"Code" lines are the non-blank lines that are not only a comment. "Bookkeeping" lines are the code
lines inside functions whose names say argument parsing, the run directory (resume, save,
overwrite), guards and checks, metrics and progress, or memory estimates (see BOOKKEEPING below);
every other code line, `run()` included, counts as the technique. It is a count by name, so it can
be re-run on any checkout; it is not a measure of quality.
"""

import ast
import json
import os
import re
import sys

SCRIPTS = ["onefile_train.py", "train.py", "train_fsdp.py", "finetune_lora.py", "finetune_qlora.py",
           "train_splade_unified.py", "train_splade_optimized.py", "judge_train_mps.py", "judge_train_cuda.py",
           "train_wpo_sgm_memory_efficient.py"]
BOOKKEEPING = re.compile(r"parser|check|guard|resume|save|^main$|print|report|format|spec|refuse|overwrite|updates|"
                         r"metrics|progress|estimate|memory|peak|help|number|positive|fraction|load_state|probe|args")


def measure(path):
    source = open(path, encoding="utf-8").read()
    functions = [node for node in ast.walk(ast.parse(source)) if isinstance(node, (ast.FunctionDef,
                                                                                      ast.AsyncFunctionDef))]
    longest = max(functions, key=lambda node: node.end_lineno - node.lineno, default=None)
    bookkeeping = set()
    for node in functions:
        if BOOKKEEPING.search(node.name):
            bookkeeping.update(range(node.lineno, node.end_lineno + 1))
    code = [number for number, line in enumerate(source.splitlines(), 1)
            if line.strip() and not line.strip().startswith("#")]
    return {"lines": len(source.splitlines()),
            "longest_function": longest.name if longest else None,
            "longest_function_lines": longest.end_lineno - longest.lineno + 1 if longest else 0,
            "code_lines": len(code), "technique_lines": len([n for n in code if n not in bookkeeping])}


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    print(json.dumps({"bench": "script_lines", "checkout": root,
                      "scripts": {name: measure(os.path.join(root, name)) for name in SCRIPTS
                                  if os.path.exists(os.path.join(root, name))}}, indent=1))


if __name__ == "__main__":
    main()
