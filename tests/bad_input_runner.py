"""Runs many bad-input cases of one app, each as a fresh process would, at the cost of one start.

    python tests/bad_input_runner.py CASES.json RESULTS.json

CASES.json: {"app": "classify", "tree": DIR, "logs": DIR, "cases": [{"args": [...], "env": {...}}]};
a case may also name files to remove before it runs ("remove": [...]), and a function after
whose return the child sends itself SIGTERM ("sigterm_after": "keras:Model.save"), a signal
that arrives at a chosen moment of the run instead of at a time a test would have to guess.
This process imports `apps.<app>` (and TensorFlow) once; each case then runs in a child forked
from it, before any TensorFlow runtime exists, so every case starts from unparsed flags and an
uninitialised runtime exactly like `python -m apps.<app> ARGS` (logical CPU devices, strategies
and TF_CONFIG included). A child gets its own empty working directory under DIR/case<i>, the
case's environment, and its file descriptors 1 and 2 sent to log files outside DIR. RESULTS.json
gets, per case: the exit status, stdout, stderr and every file that appeared or changed under
DIR (fixtures included) while it ran.
"""

import functools
import importlib
import json
import os
import signal
import sys
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def snapshot(tree: str) -> dict[str, int | None]:
    """Every path under `tree`: a file's modification time, None for a directory (whose time
    moves when something is created and removed in it, e.g. the write probe of
    `tfmp.run_dir.writable_dir`, which leaves nothing behind)."""
    found = {}
    for folder, directories, files in os.walk(tree):
        found.update({os.path.join(folder, name): None for name in directories})
        found.update(
            {os.path.join(folder, name): os.lstat(os.path.join(folder, name)).st_mtime_ns for name in files}
        )
    return found


def sigterm_after(target: str) -> None:
    """Wraps `module:attribute.path` so that the process sends itself SIGTERM when it returns."""
    module_name, _, path = target.partition(":")
    owner = importlib.import_module(module_name)
    *parents, name = path.split(".")
    for parent in parents:
        owner = getattr(owner, parent)
    original = getattr(owner, name)

    @functools.wraps(original)
    def wrapped(*args, **kwargs):
        result = original(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGTERM)
        return result

    setattr(owner, name, wrapped)


def run_child(app: str, module, case: dict, workdir: str, stdout: str, stderr: str) -> None:
    """In the forked child: never returns."""
    code = 1
    try:
        if case.get("sigterm_after"):
            sigterm_after(case["sigterm_after"])
        os.chdir(workdir)
        os.environ.update(case.get("env", {}))
        for descriptor, path in ((1, stdout), (2, stderr)):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), descriptor)
        sys.argv = [f"python -m apps.{app}", *case["args"]]
        module.cli.run(module.main, positional_arguments=app == "predict")
        code = 0
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    except BaseException:  # what a user would see as a traceback
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def main(cases_path: str, results_path: str) -> None:
    with open(cases_path, encoding="utf-8") as file:
        spec = json.load(file)
    app, tree, logs = spec["app"], spec["tree"], spec["logs"]
    module = importlib.import_module(f"apps.{app}")
    if "tensorflow" in sys.modules:  # as an app's held-back start does (apps.cli): CUDA's probe
        sys.modules["tensorflow"].config.list_physical_devices("GPU")
    results = []
    for index, case in enumerate(spec["cases"]):
        workdir = os.path.join(tree, f"case{index}")
        os.makedirs(workdir)
        stdout, stderr = (os.path.join(logs, f"{app}{index}.{name}") for name in ("out", "err"))
        for path in case.get("remove", []):
            os.remove(path)
        before = snapshot(tree)
        child = os.fork()
        if child == 0:
            run_child(app, module, case, workdir, stdout, stderr)
        _, status = os.waitpid(child, 0)
        after = snapshot(tree)
        written = sorted(path for path, stamp in after.items() if path not in before or before[path] != stamp)
        with open(stdout, encoding="utf-8") as out, open(stderr, encoding="utf-8") as err:
            results.append(
                {
                    "returncode": os.waitstatus_to_exitcode(status),
                    "stdout": out.read(),
                    "stderr": err.read(),
                    "written": written,
                }
            )
    with open(results_path, "w", encoding="utf-8") as file:
        json.dump(results, file)


if __name__ == "__main__":
    main(*sys.argv[1:])
