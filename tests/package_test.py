"""The package face: what a user constructs, passes and catches is importable from
``kvoffload`` itself, and is the same object as in its module; and the package's layers:
imports run one way, from vllm down to util, without circles."""

import ast
import pathlib

import kvoffload
from kvoffload.copy import methods as copy_methods
from kvoffload.costs import cache as calibration_cache
from kvoffload.costs import auto
from kvoffload.jobs import handler
from kvoffload.pages import paths as page_methods
from kvoffload.pages import planner
from kvoffload.pool import memory as pool_memory
from kvoffload.pool import host_pool


def test_every_exported_name_exists():
    missing = [name for name in kvoffload.__all__ if not hasattr(kvoffload, name)]
    assert not missing


def test_the_handler_its_specs_options_and_errors_are_exported_as_defined():
    for module, names in ((handler, ["OffloadHandler", "TransferResult"]), (planner, ["GPUSpec", "CPUSpec"]),
                          (host_pool, ["PoolOptions", "PoolNotReadyError"]),
                          (pool_memory, ["PinnedMemoryError"]), (calibration_cache, ["CalibrationCacheError"]),
                          (page_methods, ["Pages", "PagePath"]), (auto, ["Auto"]),
                          (copy_methods, ["PerCopy", "Batch", "Kernel", "Staged"])):
        for name in names:
            assert name in kvoffload.__all__
            assert getattr(kvoffload, name) is getattr(module, name)


# The package's layers, lowest first: a module imports only from its own layer or lower ones.
LAYERS = ["util", "copy", "pages", "pool", "meter", "costs", "jobs", "vllm"]


def _imports(root):
    """{module: {(imported module, at top level)}} for every module under root, kvoffload's own only."""
    modules = {}
    for path in pathlib.Path(root).rglob("*.py"):
        parts = path.relative_to(root).with_suffix("").parts
        name = ".".join(("kvoffload",) + (parts[:-1] if parts[-1] == "__init__" else parts))
        modules[name] = path
    found = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        tree = ast.parse(path.read_text())
        top = set(map(id, tree.body))
        found[name] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
                if any(t.split(".")[0] == "kvoffload" for t in targets):
                    found[name].add(("absolute", id(node) in top))
                continue
            if not isinstance(node, ast.ImportFrom):
                continue
            if not node.level:
                if (node.module or "").split(".")[0] == "kvoffload":
                    found[name].add(("absolute", id(node) in top))
                continue
            base = package.split(".")[:len(package.split(".")) - node.level + 1]
            module = ".".join(base + ([node.module] if node.module else []))
            for alias in node.names:
                if module == "kvoffload" and alias.name == "_C":
                    continue  # the extension, under every layer
                target = f"{module}.{alias.name}"
                found[name].add((target if target in modules else module, id(node) in top))
    return found


def _layer(module):
    parts = module.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else None


def layer_faults(root):
    """Absolute imports of kvoffload inside it, imports of a higher layer, and import circles."""
    found = _imports(root)
    faults = [f"{m}: imports kvoffload by its absolute name" for m, ts in found.items() if ("absolute", True) in ts
              or ("absolute", False) in ts]
    for module, targets in found.items():
        for target, _ in targets:
            if target != "absolute" and _layer(module) is not None and (
                    target == "kvoffload" or (_layer(target) or 0) > _layer(module)):
                faults.append(f"{module}: imports {target}, a higher layer")

    def visit(module, path):
        if module in path:
            faults.append("circle: " + " -> ".join(path[path.index(module):] + [module]))
            return
        for target, _ in found.get(module, ()):
            if target in found and not target.startswith(module + "."):  # a package loads its own modules
                visit(target, path + [module])
    for module in found:
        visit(module, [])
    return sorted(set(faults))


def test_the_package_imports_run_one_way_from_vllm_down_to_util_without_circles():
    root = pathlib.Path(kvoffload.__file__).parent
    assert {p.name for p in root.iterdir() if p.is_dir() and (p / "__init__.py").exists()} == set(LAYERS)
    assert layer_faults(root) == []


def test_the_layer_check_finds_an_upward_import_a_circle_and_an_absolute_import(tmp_path):
    for layer in ("util", "copy", "jobs"):
        (tmp_path / layer).mkdir()
        (tmp_path / layer / "__init__.py").write_text("")
    (tmp_path / "__init__.py").write_text("from .jobs.handler import Handler\n")
    (tmp_path / "util" / "words.py").write_text("def f():\n    from ..jobs.handler import Handler\n")
    (tmp_path / "copy" / "a.py").write_text("from .b import B\nA = 1\n")
    (tmp_path / "copy" / "b.py").write_text("from .a import A\nB = 1\n")
    (tmp_path / "jobs" / "handler.py").write_text("from ..util.words import f\nfrom kvoffload.copy.a import A\n")
    assert layer_faults(tmp_path) == [
        "circle: kvoffload.copy.a -> kvoffload.copy.b -> kvoffload.copy.a",
        "circle: kvoffload.copy.b -> kvoffload.copy.a -> kvoffload.copy.b",
        "circle: kvoffload.jobs.handler -> kvoffload.util.words -> kvoffload.jobs.handler",
        "circle: kvoffload.util.words -> kvoffload.jobs.handler -> kvoffload.util.words",
        "kvoffload.jobs.handler: imports kvoffload by its absolute name",
        "kvoffload.util.words: imports kvoffload.jobs.handler, a higher layer",
    ]
