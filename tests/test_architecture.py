"""The library's structure: no import cycles between hpf modules (imports inside functions
count too), and no library file over 700 lines. Both are read from the source with ``ast``,
so the test fails the moment a change breaks either rule."""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("hpf", "hpf_kernels")
MAX_LINES = 700



def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def library_files() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """Library modules ``path`` imports anywhere in its body (a package import counts as its __init__)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for t in targets:
            while t and t not in modules:
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def import_graph() -> dict[str, set[str]]:
    files = library_files()
    modules = {module_name(p) for p in files}
    return {module_name(p): imports_of(p, modules) for p in files}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def is_package_edge(a: str, b: str) -> bool:
    """A package's __init__ importing its own submodules (and they importing siblings through
    it) is how packages work, not a cycle between ideas."""
    return a.startswith(b + ".") or b.startswith(a + ".")


def test_no_import_cycles_between_library_modules():
    graph = import_graph()
    graph = {a: {b for b in bs if not is_package_edge(a, b)} for a, bs in graph.items()}
    found = list(cycles(graph))
    assert not found, f"import cycles (imports inside functions count): {found}"


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_library_file_over_700_lines():
    long = {str(p.relative_to(ROOT)): n for p in library_files()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"library files over {MAX_LINES} lines: {long}"


#: folders already split along their seams (issue 59), held to the target every module will meet
SPLIT_MAX_LINES = {"hpf/optim": 450, "hpf/sim": 450, "hpf/validate": 450, "hpf/models": 450, "hpf/comm": 450,
                   "hpf/planning": 450, "hpf/launcher": 450, "hpf/checkpoint": 450,
                   "hpf/step": 450, "hpf/elastic": 450}


def test_split_folders_have_no_module_over_their_limit_and_one_idea_each():
    """No module of a split folder over its limit, and each opens with a docstring (its one idea)."""
    bad = {}
    for folder, limit in SPLIT_MAX_LINES.items():
        for p in sorted((ROOT / folder).glob("*.py")):
            text = p.read_text()
            if len(text.splitlines()) > limit or (p.name != "__init__.py" and not ast.get_docstring(ast.parse(text))):
                bad[str(p.relative_to(ROOT))] = len(text.splitlines())
    assert not bad, f"over the folder's limit {SPLIT_MAX_LINES} or without a first docstring line: {bad}"


def oversized(source: str, max_class: int = 250, max_function: int = 60) -> list[str]:
    """The classes and functions in ``source`` longer than the limits (docstrings included)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        limit = max_class if isinstance(node, ast.ClassDef) else max_function if isinstance(
            node, (ast.FunctionDef, ast.AsyncFunctionDef)) else None
        if limit is not None and node.end_lineno - node.lineno + 1 > limit:
            out.append(f"{node.name} ({node.end_lineno - node.lineno + 1} lines)")
    return out


def test_no_class_over_250_lines_and_no_function_over_60():
    """A unit of code one can read at once: split by what each part is for, not by line count.
    (hpf/ only: hpf_kernels' Triton kernels are written as one function each, and only a GPU runs them.)"""
    long = {str(p.relative_to(ROOT)): bad for p in sorted((ROOT / "hpf").rglob("*.py")) if (bad := oversized(p.read_text()))}
    assert not long, long


def test_the_size_scan_finds_a_long_function_inside_a_class():
    body = "\n".join(f"        x = {i}" for i in range(60))
    assert oversized(f"class A:\n    def f(self):\n{body}\n") == ["f (61 lines)"]


def package_code(source: str) -> list[str]:
    """What a package file holds besides its docstring, imports, ``__all__`` and a lazy
    ``__getattr__`` (re-exports): the names of its other top-level statements."""
    import ast
    out = []
    for node in ast.parse(source).body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):  # the docstring
            continue
        if isinstance(node, ast.Assign) and [getattr(t, "id", "") for t in node.targets] in (["__all__"], ["_LAZY"]):
            continue
        if isinstance(node, ast.FunctionDef) and node.name == "__getattr__":
            continue
        out.append(getattr(node, "name", None) or ast.unparse(node).split("\n")[0][:40])
    return out


def test_subpackage_files_only_re_export():
    """A package file says what the package is and re-exports its names; the code lives in the
    modules named for it (hpf/__init__.py, the public surface, is the exception)."""
    found = {str(p.relative_to(ROOT)): (len(p.read_text().splitlines()), package_code(p.read_text()))
             for p in sorted([*(ROOT / "hpf").glob("*/__init__.py"), ROOT / "hpf_kernels" / "__init__.py"])}
    assert {f: v for f, v in found.items() if v[0] >= 40 or v[1]} == {}
    assert package_code("import x\nSIZE = 2\ndef f(): pass\n") == ["SIZE = 2", "f"]


def test_models_never_import_validation_code():
    """Models run validation mode's checks by name (hpf.comm.collectives.run_check), so the
    dependency points from validate to models' hooks, never from models to validate."""
    graph = import_graph()
    wrong = {m: sorted(i for i in imports if i.startswith("hpf.validate")) for m, imports in graph.items()
             if m.startswith("hpf.models")}
    assert not any(wrong.values()), f"models importing hpf.validate: {wrong}"


def test_validation_never_reaches_into_the_comms_low_bit_tier():
    """The comm owns its low-bit tier (its residuals, its capture): validation mode asks the comm
    (``capture_low_bit``, ``low_bit_captures``), never reads ``comm.lowbit``."""
    found = [(str(p.relative_to(ROOT)), node.lineno) for p in sorted((ROOT / "hpf" / "validate").glob("*.py"))
             for node in ast.walk(ast.parse(p.read_text())) if isinstance(node, ast.Attribute) and node.attr == "lowbit"]
    assert not found, f"validation reads the comm's low-bit tier: {found}"


def test_checkpoint_never_imports_an_optimizer_implementation():
    """Checkpoints place optimizer state by what the optimizer says (its capabilities' state_layout)."""
    imports = {i for m, imports in import_graph().items() if m == "hpf.checkpoint" or m.startswith("hpf.checkpoint.")
               for i in imports}
    assert "hpf.optim.base" in imports  # (the scan sees the package's modules)
    assert not {i for i in imports if i.startswith("hpf.optim.") and i != "hpf.optim.base"}, imports


# The layers, lowest first: a module may import from its own layer and the layers below, never
# from one above (docs/architecture.md, "Layers"). A module is in the layer of its longest prefix.
LAYERS = [
    ("foundation", ("hpf_kernels", "hpf.errors", "hpf.tree", "hpf.precision", "hpf.topology", "hpf.train_state", "hpf.mesh", "hpf.spec", "hpf.trace", "hpf.progress",
                    "hpf.plots", "hpf.losses", "hpf.checkpoint_files", "hpf.checkpoint_check", "hpf.models.recompute", "hpf.engine.residency",
                    "hpf.engine.unit_state",
                    "hpf.validate.layout", "hpf.sim.hardware", "hpf.optim.base", "hpf.optim.lr_schedules", "hpf.random")),
    ("planning", ("hpf.planning",)),
    ("comm", ("hpf.comm", "hpf.launcher")),
    ("optimizers and models", ("hpf.optim", "hpf.models")),
    ("the step's parts", ("hpf.engine", "hpf.misuse", "hpf.batching", "hpf.decision", "hpf.report", "hpf.data",
                          "hpf.config", "hpf.sharded_init")),
    ("the step", ("hpf.step", "hpf.state_io", "hpf.checkpoint", "hpf.func", "hpf.memory", "hpf.validate", "hpf.modes",
                  "hpf.module", "hpf.elastic")),
    ("tools", ("hpf.jobspec", "hpf.sim", "hpf.search", "hpf.cli", "hpf.__main__")),
]


def layer_of(module: str) -> int:
    found = [(len(prefix), i) for i, (_, prefixes) in enumerate(LAYERS) for prefix in prefixes
             if module == prefix or module.startswith(prefix + ".")]
    assert found, f"{module} is in no layer: add it to LAYERS (and to docs/architecture.md)"
    return max(found)[1]


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """``a -> b`` for each import of a module in a higher layer (the package root ``hpf`` loads
    names lazily, so importing it is free)."""
    return [f"{a} ({LAYERS[layer_of(a)][0]}) -> {b} ({LAYERS[layer_of(b)][0]})" for a, bs in sorted(graph.items())
            for b in sorted(bs) if b != "hpf" and a != "hpf" and layer_of(b) > layer_of(a)]


def test_no_module_imports_from_a_higher_layer():
    wrong = upward_imports(import_graph())
    assert not wrong, "imports from a higher layer (imports inside functions count):\n" + "\n".join(wrong)


def test_the_layer_check_finds_an_upward_import():
    graph = {"hpf.planning": {"hpf.report", "hpf.mesh"}, "hpf.comm.schedule": {"hpf.comm.world"}}
    assert upward_imports(graph) == ["hpf.planning (planning) -> hpf.report (the step's parts)"]


# torch.distributed is called under hpf/comm/ only, and where a process group is made: each
# exception with its reason.
DIST_ALLOWED = {
    "hpf/launcher/group.py": "starts and ends the process group",
    "hpf/launcher/fork.py": "hpf.launch: refuses to fork from a process group, gathers the results under torchrun",
    "hpf/mesh.py": "makes the mesh's process groups (it lies below hpf/comm/, which uses them)",
}


def dist_calls(source: str) -> list[tuple[int, str]]:
    """``(line, call)`` for each ``dist.*`` / ``torch.distributed.*`` call (torch.distributed.checkpoint
    is DCP, hpf.checkpoint's storage, not a collective)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            name = ast.unparse(node.func)
            if (name.startswith(("dist.", "torch.distributed.")) and not name.startswith("torch.distributed.checkpoint")
                    and not name.startswith(("torch.distributed.fsdp", "torch.distributed.device_mesh"))):
                out.append((node.lineno, name))
    return out


def test_torch_distributed_is_called_only_under_comm():
    found = [(str(p.relative_to(ROOT)), line, call) for p in library_files()
             for line, call in dist_calls(p.read_text())
             if not str(p.relative_to(ROOT)).startswith("hpf/comm/") and str(p.relative_to(ROOT)) not in DIST_ALLOWED]
    assert not found, f"torch.distributed calls outside hpf/comm/ (add a helper to hpf.comm.world): {found}"


def test_the_dist_scan_finds_calls():
    source = "import torch.distributed as dist\ndist.barrier()\ntorch.distributed.all_reduce(x)\ndcp.save(x)\n"
    assert dist_calls(source) == [(2, "dist.barrier"), (3, "torch.distributed.all_reduce")]


def private_uses(path: Path, modules: set[str], name: str | None = None) -> list[str]:
    """Uses of another hpf module's private names: ``from m import _x``, or ``m._x`` where ``m``
    names a module (``name``: the module ``path`` is, if not under the repository)."""
    name = name or module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    aliases, out = {}, []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for a in node.names:
                if f"{base}.{a.name}" in modules:
                    aliases[a.asname or a.name] = f"{base}.{a.name}"
                elif base in modules and a.name.startswith("_") and not a.name.startswith("__"):
                    out.append(f"from {base} import {a.name}")
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                and node.attr.startswith("_") and not node.attr.startswith("__")):
            out.append(f"{aliases[node.value.id]}.{node.attr} (line {node.lineno})")
    return out


def test_no_module_uses_another_modules_private_names():
    modules = {module_name(p) for p in library_files()}
    found = {str(p.relative_to(ROOT)): uses for p in library_files() if (uses := private_uses(p, modules))}
    assert not found, f"private names used across modules (make them public where they are defined): {found}"


def test_the_private_name_scan_finds_both_forms(tmp_path):
    user = tmp_path / "tracker.py"
    user.write_text("from ..comm import collectives\nfrom ..comm.collectives import _helper\ncollectives._dim(x)\n")
    found = private_uses(user, {"hpf.comm", "hpf.comm.collectives", "hpf.validate.tracker"}, "hpf.validate.tracker")
    assert found == ["from hpf.comm.collectives import _helper", "hpf.comm.collectives._dim (line 3)"]


def module_map() -> list[str]:
    """The paths docs/architecture.md's module map names: the backticked .py paths and folders of
    each row's first cell, relative to hpf/ unless they start with hpf/ or hpf_kernels/."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    table = text.split("## Module map", 1)[1].split("\n## ", 1)[0]
    paths = []
    for row in table.splitlines():
        if not row.startswith("| `"):
            continue
        for token in re.findall(r"`([^`]+)`", row.split(" | ")[0]):
            if token.endswith((".py", "/")):
                paths.append(token if token.startswith(PACKAGES) else f"hpf/{token}")
    return paths


def test_the_module_map_lists_every_module_and_only_modules_that_exist():
    listed = module_map()
    assert listed, "no rows found in docs/architecture.md's module map"
    missing = [p for p in listed if not (ROOT / p).exists()]
    assert not missing, f"docs/architecture.md lists modules that do not exist: {missing}"
    folders = tuple(p for p in listed if p.endswith("/"))
    packages = {str(Path(p).parent) for p in listed if p.endswith(".py")}  # a package goes with its listed modules
    unlisted = [str(p.relative_to(ROOT)) for p in library_files()
                if str(p.relative_to(ROOT)) not in listed and not str(p.relative_to(ROOT)).startswith(folders)
                and not (p.name == "__init__.py" and str(p.parent.relative_to(ROOT)) in packages)]
    assert not unlisted, f"modules missing from docs/architecture.md's module map: {unlisted}"


# Calls that run code from the bytes they read. Allowed only where the bytes cannot come from
# disk or the network, each with its reason.
CODE_FROM_DATA_ALLOWED = {
    ("hpf/launcher/results.py", "pickle.loads"): "a rank's result, through the pipe to the child hpf.launch forked",
}


def code_from_data_calls(source: str) -> list[tuple[int, str]]:
    """``(line, call)`` for each call in ``source`` that may run code from data: pickle/marshal/dill
    loads, a pickle.Unpickler used as is (not subclassed with a find_class), ``torch.load``
    without ``weights_only=True``, and ``eval``/``exec``."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        name = ast.unparse(node.func)
        if name in ("eval", "exec", "builtins.eval", "builtins.exec", "compile"):
            out.append((node.lineno, name))
        elif re.fullmatch(r"(pickle|cPickle|_pickle|marshal|dill|cloudpickle|shelve)\.(load|loads|Unpickler|open)",
                          name):
            out.append((node.lineno, name))
        elif name.split(".")[-1] == "load" and name.startswith("torch"):
            safe = any(k.arg == "weights_only" and isinstance(k.value, ast.Constant) and k.value.value is True
                       for k in node.keywords)
            if not safe:
                out.append((node.lineno, name))
    return out


def test_nothing_in_the_library_runs_code_from_data():
    """A checkpoint, a store value, a plan file is data: hpf never unpickles what it reads from
    disk or the network, never torch.loads without weights_only=True, never evals."""
    found = [(str(p.relative_to(ROOT)), line, call) for p in library_files()
             for line, call in code_from_data_calls(p.read_text())
             if (str(p.relative_to(ROOT)), call) not in CODE_FROM_DATA_ALLOWED]
    assert not found, f"calls that run code from data (use JSON, or torch.load(weights_only=True)): {found}"


def test_the_code_from_data_scan_finds_each_forbidden_call():
    source = ("import pickle, torch\npickle.load(f)\npickle.loads(b)\ntorch.load(p)\n"
              "torch.load(p, weights_only=False)\ntorch.load(p, weights_only=True)\neval('1')\nexec('x=1')\n"
              "pickle.Unpickler(f).load()\n")
    assert [c for _, c in code_from_data_calls(source)] == ["pickle.load", "pickle.loads", "torch.load", "torch.load",
                                                            "eval", "exec", "pickle.Unpickler"]
