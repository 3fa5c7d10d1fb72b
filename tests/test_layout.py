"""The package layout stays a layered house: no import cycles, no lower layer importing a higher
one, and no tfmp import hidden inside a function (except the few whose reason is written here).

Read from the source with `ast`, so it costs milliseconds and imports nothing.
"""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Lowest first: a module may import its own layer and the layers below it, never above.
LAYERS = [
    ("tfmp.errors", "tfmp.run_dir", "tfmp.write_faults", "tfmp.compat"),
    ("tfmp.models",),
    ("tfmp.precision", "tfmp.optim", "tfmp.distribute", "tfmp.input"),
    ("tfmp.pipeline", "tfmp.pruning", "tfmp.training"),
    ("tfmp.classification", "tfmp.detection"),
    ("tfmp.serving",),
    ("tfmp.bench",),
    ("apps",),
]
# Thin re-exports that keep documented import paths; they sit above what they re-export.
SHIMS = {"tfmp.launch", "tfmp"}
# tfmp imports inside functions, each with its reason.
LAZY_IMPORTS = {
    # `import tfmp` / `python -m tfmp.launch` must not import TensorFlow: fit/evaluate load on use.
    ("tfmp", "tfmp.training.fitting"),
    ("tfmp", "tfmp.training.evaluating"),
    ("tfmp", "tfmp.precision.fused_norm"),  # tfmp.fuse_normalization, likewise
    # A training matrix's parent process must not hold TensorFlow (the cells run in fresh ones).
    ("apps.bench", "tfmp.bench.inference"),
}


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _sources() -> dict[str, pathlib.Path]:
    files = [*ROOT.joinpath("tfmp").rglob("*.py"), *ROOT.joinpath("apps").glob("*.py")]
    return {_module_name(path): path for path in files}


def _targets(node, modules) -> set[str]:
    """The project modules an import statement loads (`from a import b` may name module a.b)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    elif node.module and node.level == 0:
        names = [
            f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in modules else node.module
            for alias in node.names
        ]
    else:
        return set()
    found = set()
    for name in names:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        if name:
            found.add(name)
    return found


def _imports(modules):
    """module -> (module-level imports, imports inside functions); an `if TYPE_CHECKING:` import
    counts as a module-level one: an annotation that needs a circle is a circle."""
    result = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        top, lazy = set(), set()

        def visit(node, in_function, top=top, lazy=lazy):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.Import, ast.ImportFrom)):
                    (lazy if in_function else top).update(_targets(child, modules))
                visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))

        visit(tree, False)
        result[name] = (top - {name}, lazy - {name})
    return result


def _layer(module: str) -> int:
    for index, prefixes in enumerate(LAYERS):
        if any(module == prefix or module.startswith(prefix + ".") for prefix in prefixes):
            return index
    raise AssertionError(f"{module} is in no layer of tests/test_layout.py: place it")


def test_every_module_has_a_layer_and_imports_only_its_own_or_lower_layers():
    modules = _sources()
    wrong = [
        f"{module} (layer {_layer(module)}) imports {target} (layer {_layer(target)})"
        for module, (top, _) in _imports(modules).items()
        if module not in SHIMS
        for target in sorted(top)
        if _layer(target) > _layer(module)
    ]
    assert not wrong, "\n".join(wrong)


def test_no_import_cycles():
    graph = {module: top for module, (top, _) in _imports(_sources()).items()}
    state, cycles = {}, []

    def visit(module, trail):
        state[module] = "open"
        for target in sorted(graph.get(module, ())):
            if state.get(target) == "open":
                cycles.append(" -> ".join(trail[trail.index(target) :] + [target]))
            elif target not in state:
                visit(target, trail + [target])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycles, "\n".join(cycles)


def test_no_tfmp_import_hidden_in_a_function_without_a_reason():
    hidden = sorted(
        (module, target)
        for module, (_, lazy) in _imports(_sources()).items()
        for target in lazy
        if (module, target) not in LAZY_IMPORTS
    )
    assert not hidden, "\n".join(f"{module} imports {target} inside a function" for module, target in hidden)
