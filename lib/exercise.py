"""Exercises: put a learner's version of a technique in place of the project's own, in the real scripts.

Used where an exercise's reference lives (lib/gpt, lib/lm_loss, lib/lora, lib/nf4, lib/adam8bit and the SPLADE and
WPO-SGM scripts) and by the tests in exercises/. The one idea: the reference stays the only copy of a solution; a
line such as `LoRALinear = exercise.swap("lora", LoRALinear)` after it hands the name to the learner's
exercises/lora.py when the run is started with BYHAND_EXERCISE=lora, and the run says so.

    BYHAND_EXERCISE=lora python finetune_lora.py     # the real script, trained with your LoRALinear
    python -m pytest exercises/test_lora.py           # your exercises/lora.py against the reference
"""

import importlib
import importlib.util
import os
import sys
import types

from lib.errors import UserError, report_and_exit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def chosen() -> set:
    """The exercises named by BYHAND_EXERCISE (comma-separated), e.g. "lora" or "nf4,lora"."""
    return {n.strip() for n in os.environ.get("BYHAND_EXERCISE", "").split(",") if n.strip()}


def path_of(name: str) -> str:
    """exercises/<name>.py, or <BYHAND_EXERCISE_DIR>/<name>.py (a teacher's or a test's folder of solutions)."""
    return os.path.join(os.environ.get("BYHAND_EXERCISE_DIR") or os.path.join(ROOT, "exercises"), f"{name}.py")


def fail(message: str):
    """One line and exit 2 (this runs while a script imports lib/, before its main() can catch a UserError)."""
    report_and_exit(UserError(message))


def learner_module(name: str) -> types.ModuleType:
    """The learner's file for exercise `name`, imported from its path (one module object per exercise)."""
    key = f"byhand_exercise_{name}"
    if key not in sys.modules:
        path = path_of(name)
        if not os.path.isfile(path):
            fail(f"exercise {name!r}: there is no {path}; BYHAND_EXERCISE names a file of exercises/ "
                 f"(see exercises/README.md)")
        spec = importlib.util.spec_from_file_location(key, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        spec.loader.exec_module(module)
    return sys.modules[key]


def swap(name: str, reference):
    """`reference` itself, unless BYHAND_EXERCISE names this exercise: then the learner's object of the same name."""
    if name not in chosen():
        return reference
    module, attr = learner_module(name), reference.__name__
    if not hasattr(module, attr):
        fail(f"exercise {name!r}: {path_of(name)} has no {attr}; keep the stub's names")
    where = reference.__module__
    if where == "__main__":  # a script run directly: name its file
        where = os.path.splitext(os.path.basename(sys.modules["__main__"].__file__))[0]
    print(f"exercise {name}: using your {attr} from {os.path.relpath(path_of(name))} in place of {where}.{attr}",
          flush=True)
    return getattr(module, attr)


def resolve(dotted: str):
    """'lib.lora.LoRALinear' -> the object (a module path, then one attribute)."""
    module, _, attr = dotted.rpartition(".")
    return getattr(importlib.import_module(module), attr)


def load(name: str):
    """What exercises/test_<name>.py tests: the learner's module; with BYHAND_EXERCISE_REFERENCE=1, the project's own
    implementations under the same names (each stub's REFERENCE maps a name to where its solution lives)."""
    module = learner_module(name)
    if os.environ.get("BYHAND_EXERCISE_REFERENCE") != "1":
        return module
    return types.SimpleNamespace(**{n: resolve(where) for n, where in module.REFERENCE.items()})
