"""The rules of the house that a machine can check (docs/architecture.md)."""
import ast
import dataclasses
from collections import deque
from pathlib import Path


PACKAGE = Path(__file__).resolve().parents[2] / "verl_hpc"
# runtime/ decides CPU or CUDA; cpu_compat stands in for torch.cuda inside megatron on CPU
CUDA_ALLOWED = ("runtime/", "parallel/cpu_compat.py")


def _cuda_uses(path: Path):
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr == "cuda"
                and isinstance(node.value, ast.Name) and node.value.id == "torch"):
            yield node.lineno


def test_only_runtime_reaches_torch_cuda():
    found = [f"{p.relative_to(PACKAGE)}:{line}" for p in sorted(PACKAGE.rglob("*.py"))
             if not str(p.relative_to(PACKAGE)).startswith(CUDA_ALLOWED) for line in _cuda_uses(p)]
    assert not found, f"torch.cuda outside runtime/ (go through verl_hpc.runtime.device): {found}"


def test_the_check_sees_a_use(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("import torch\n# torch.cuda in a comment\nx = torch.cuda.is_available()\n")
    assert list(_cuda_uses(f)) == [3]


# Modules small: one concern each. Past this a module is split along its seams (docs/architecture.md).
MAX_MODULE_LINES = 450


def long_modules(root: Path, limit: int = MAX_MODULE_LINES):
    """'path: N lines' for each module under `root` longer than `limit` lines."""
    found = []
    for path in sorted(root.rglob("*.py")):
        n = len(path.read_text().splitlines())
        if n > limit:
            found.append(f"{path.relative_to(root.parent)}: {n} lines")
    return found


def test_no_product_module_past_450_lines():
    found = long_modules(PACKAGE)
    assert not found, (f"modules past {MAX_MODULE_LINES} lines (split each along its seams: one concern a "
                       "module):\n" + "\n".join(found))


def test_the_length_check_sees_a_long_module(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "sub" / "long.py").write_text("x = 1\n" * (MAX_MODULE_LINES + 1))
    (pkg / "sub" / "edge.py").write_text("x = 1\n" * MAX_MODULE_LINES)  # at the limit: allowed
    (pkg / "short.py").write_text("x = 1\n")
    assert long_modules(pkg) == [f"pkg/sub/long.py: {MAX_MODULE_LINES + 1} lines"]


# The layers of verl_hpc, bottom first (docs/layers.md says why each sits where it does). A module
# may import from its own layer and the ones below, never from one above. Every top-level package
# or module of verl_hpc must be named here: a new one is placed on purpose.
LAYERS = (
    ("errors",),  # the error base: stdlib only
    ("config",),
    ("runtime",),
    ("tracking",),
    ("models", "parallel"),
    ("planning",),
    ("rewards",),  # scoring functions; data's preprocessors write ground truth in their format
    ("data",),
    ("rollout",),
    ("algorithms",),
    ("checkpoint",),  # the storage format; engines describe their state in its ShardedTensor
    ("engines",),
    ("resharding",),
    ("trainer",),
    ("job", "launcher", "gpu_check", "plan"),
    ("submit",),
)


def _type_checking(test) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def module_imports(root: Path, type_only: bool = False):
    """{module: [(imported module of the same package, line)]} for every module under `root`,
    module-level and function-level imports alike; those under `if TYPE_CHECKING:` never run, and
    count only with `type_only`."""
    files = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path

    def resolve(name: str) -> str:  # `from pkg.mod import func` imports pkg.mod
        while name not in files and "." in name:
            name = name.rsplit(".", 1)[0]
        return name

    graph = {}
    for mod, path in files.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        found = []
        stack = [ast.parse(path.read_text(), str(path))]
        while stack:
            node = stack.pop()
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.If) and _type_checking(child.test):
                    # the branch's statements, held in a node whose children they are
                    stack.append(ast.Module(body=child.orelse + (child.body if type_only else []), type_ignores=[]))
                elif isinstance(child, ast.Import):
                    found += [(a.name, child.lineno) for a in child.names]
                elif isinstance(child, ast.ImportFrom):
                    base = child.module or ""
                    if child.level:
                        up = package.split(".")[:len(package.split(".")) - child.level + 1]
                        base = ".".join(up + ([child.module] if child.module else []))
                    found += [(f"{base}.{a.name}" if f"{base}.{a.name}" in files else base, child.lineno)
                              for a in child.names]
                else:
                    stack.append(child)
        graph[mod] = sorted({(resolve(name), line) for name, line in found
                             if name == root.name or name.startswith(root.name + ".")}, key=lambda x: x[1])
    return graph


def upward_imports(graph, layers):
    """'a.b:12 imports c.d (layer config below layer trainer)'-style lines, one per upward import."""
    rank = {name: i for i, names in enumerate(layers) for name in names}

    def layer(mod: str):
        parts = mod.split(".")
        return rank[parts[1]] if len(parts) > 1 else -1  # the root package: nothing above it

    unknown = sorted({m.split(".")[1] for m in graph if "." in m} - set(rank))
    assert not unknown, f"place these in LAYERS: {unknown}"
    return [f"{mod}:{line} imports {target} ({layers[layer(target)][0]} layer is above "
            f"{layers[layer(mod)][0]} layer)"
            for mod, edges in sorted(graph.items()) for target, line in edges if layer(target) > layer(mod)]


def _edges(graph):
    return {m: sorted({t for t, _ in e if t != m}) for m, e in graph.items()}


def import_groups(graph):
    """The groups of modules that import each other, each a set (Tarjan's strongly connected components)."""
    edges = _edges(graph)
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while v not in group:
                group.add(stack.pop())
            on_stack.difference_update(group)
            if len(group) > 1:
                groups.append(group)

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return groups


def import_cycles(graph, groups=None):
    """One chain 'a -> b -> a' for each group of modules that import each other (default: all of them)."""
    edges = _edges(graph)
    chains = []
    for group in import_groups(graph) if groups is None else groups:
        # the shortest way back to the group's first module, as the chain to read
        start = min(group)
        came = {start: None}
        todo = deque([start])
        while todo:
            v = todo.popleft()
            for w in edges[v]:
                if w == start:
                    path = [v]
                    while came[path[-1]] is not None:
                        path.append(came[path[-1]])
                    chains.append(" -> ".join([*reversed(path), start]) + f" ({len(group)} modules in the circle)")
                    todo.clear()
                    break
                if w in group and w not in came:
                    came[w] = v
                    todo.append(w)
    return sorted(chains)


def test_imports_point_down_the_layers():
    found = upward_imports(module_imports(PACKAGE), LAYERS)
    assert not found, "imports from a higher layer (move the code down or pass the value in):\n" + "\n".join(found)


def test_no_import_circles():
    found = import_cycles(module_imports(PACKAGE))
    assert not found, "modules that import each other:\n" + "\n".join(found)


# An import under `if TYPE_CHECKING:` never runs, but a circle through one still ties the modules
# together (neither can be read, moved or tested without the other). The one kept: config/'s, where
# the job config imports every section and the sections' field checks name the job config's type.
TYPE_ONLY_CIRCLE_ALLOWED = "verl_hpc.config."


def test_no_import_circles_through_type_only_imports_but_the_configs():
    graph = module_imports(PACKAGE, type_only=True)
    groups = [g for g in import_groups(graph) if not all(m.startswith(TYPE_ONLY_CIRCLE_ALLOWED) for m in g)]
    found = import_cycles(graph, groups)
    assert not found, ("modules that import each other, counting the imports under TYPE_CHECKING (move "
                       "the shared piece down into a module of its own):\n" + "\n".join(found))


def test_the_error_base_imports_nothing_from_the_project():
    assert module_imports(PACKAGE)["verl_hpc.errors"] == []


def test_the_import_checks_see_an_upward_import_and_a_circle(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "low").mkdir(parents=True)
    for name, text in {
        "__init__.py": "",
        "low/__init__.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.high import b\n",
        "low/a.py": "def f():\n    from ..high.b import g\n    return g\n",
        "high/__init__.py": "",
        "high/b.py": "import os\nfrom pkg.high import c\n",
        "high/c.py": "def h():\n    from . import b\n",
    }.items():
        (pkg / name).parent.mkdir(parents=True, exist_ok=True)
        (pkg / name).write_text(text)
    graph = module_imports(pkg)
    assert upward_imports(graph, (("low",), ("high",))) == [
        "pkg.low.a:2 imports pkg.high.b (high layer is above low layer)"]  # not the TYPE_CHECKING one
    assert import_cycles(graph) == ["pkg.high.b -> pkg.high.c -> pkg.high.b (2 modules in the circle)"]
    assert ("pkg.high.b", 2) in graph["pkg.high.c"]  # a function's import counts
    (pkg / "high" / "e.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                       "    from pkg.high.f import F\n")
    (pkg / "high" / "f.py").write_text("from pkg.high.e import E\n")
    bc = "pkg.high.b -> pkg.high.c -> pkg.high.b (2 modules in the circle)"
    assert import_cycles(module_imports(pkg)) == [bc]  # the type-only import does not run
    graph = module_imports(pkg, type_only=True)
    assert import_cycles(graph) == [bc, "pkg.high.e -> pkg.high.f -> pkg.high.e (2 modules in the circle)"]
    assert import_cycles(graph, [g for g in import_groups(graph) if "pkg.high.e" not in g]) == [bc]


# what the programs own (trainer/): the checkpoint layer takes them as named objects, never by name
# (the whole job config is the whole-config rule's)
PROGRAM_OBJECTS = ("kl_ctrl", "task_weights", "rollback", "guard", "loader", "roles", "critic", "link",
                   "placement", "validator", "sampler")


def named_program_objects(root: Path):
    """'file:line name' for each identifier (variable, attribute, argument) in `root` that is one
    of PROGRAM_OBJECTS; strings and comments do not count."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            name = (node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute)
                    else node.arg if isinstance(node, ast.arg) else None)
            if name in PROGRAM_OBJECTS:
                found.append(f"{path.relative_to(root.parent)}:{node.lineno} {name}")
    return sorted(found)


def test_the_checkpoint_layer_names_no_program_object():
    """The checkpointer takes named engines and states (checkpoint/checkpointer.py); a new stateful
    feature registers its object in its program, without an edit here."""
    found = named_program_objects(PACKAGE / "checkpoint")
    assert not found, "the checkpoint layer names objects of the programs (take them as named states):\n" + \
        "\n".join(found)


def test_the_program_object_check_sees_a_name(tmp_path):
    (tmp_path / "checkpoint").mkdir()
    (tmp_path / "checkpoint" / "x.py").write_text("def save(self):\n    return self.kl_ctrl.state_dict()\n")
    assert named_program_objects(tmp_path / "checkpoint") == ["checkpoint/x.py:2 kl_ctrl"]


# Faults for tests are injected from tests/faults.py (docs/testing.md, "Faults in tests"): the
# product carries no test knob, in its config or its code.
def _config_keys(section, prefix=""):
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        yield prefix + f.name
        if dataclasses.is_dataclass(value):
            yield from _config_keys(value, f"{prefix}{f.name}.")


def test_no_test_fault_knob_in_the_product():
    from verl_hpc.config.schema import JobConfig

    keys = list(_config_keys(JobConfig()))
    assert "trainer.rollback.max_rollbacks" in keys  # the walk reaches nested sections
    assert not [k for k in keys if "inject_" in k], "test faults belong in tests/faults.py"
    files = [p for p in sorted(PACKAGE.rglob("*")) if p.is_file() and "__pycache__" not in p.parts]
    files.append(PACKAGE.parent / "configs" / "base.yaml")
    found = [f"{p.relative_to(PACKAGE.parent)}:{i}" for p in files
             for i, line in enumerate(p.read_text(errors="replace").splitlines(), 1) if "inject_" in line]
    assert not found, f"test faults belong in tests/faults.py, not the product: {found}"


# A component is built from its own section (docs/architecture.md): below the trainer, a function
# takes the sections it needs (or a small options object its caller built), never the whole job
# config. The top layer plans and wires the whole job and may take it.
TOP_LAYER = ("config/", "trainer/", "launcher/", "planning/", "gpu_check/", "job.py", "submit.py", "plan.py")
CONFIG_NAMES = ("cfg", "config", "job_cfg")  # a parameter of these names (or annotated JobConfig)
HOLDERS = ("cfg", "_cfg", "config", "_config", "job_cfg")  # self.<these>: a class that holds the config
# Functions below the trainer that still take the whole job config, as module:qualname. The list only
# shrinks: a function fixed comes off it, and no new one goes on.
WHOLE_CONFIG_ALLOWED = frozenset()  # none below the trainer: keep it so


def _job_sections():
    import dataclasses

    from verl_hpc.config import JobConfig

    return frozenset(f.name for f in dataclasses.fields(JobConfig))


def _functions(tree):
    """(qualname, node) of every function and method, nested ones included."""
    found = []

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found.append((prefix + child.name, child))
                visit(child, f"{prefix}{child.name}.<locals>.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)
    visit(tree, "")
    return found


def _calls_with(fn, name: str, aliases):
    """The callee keys ('f', 'Cls.m', '.m' for self.m / obj.m) of the calls that pass `name` whole."""
    for node in ast.walk(fn):
        if isinstance(node, ast.Call) and any(isinstance(a, ast.Name) and a.id == name for a in
                                              [*node.args, *(k.value for k in node.keywords)]):
            f = node.func
            if isinstance(f, ast.Name):
                yield aliases.get(f.id, f.id)
            elif isinstance(f, ast.Attribute):
                outer = f.value.id if isinstance(f.value, ast.Name) else ""
                yield f"{outer}.{f.attr}" if outer[:1].isupper() else f".{f.attr}"


def whole_config_takers(root: Path, sections) -> dict:
    """{'module:qualname': why} for every function under `root` that takes the whole job config: a
    parameter named cfg/config/job_cfg (or annotated JobConfig) whose body reads `<param>.<section>`
    or hands it whole to another such function, or a method that reads `self.cfg.<section>`."""
    entries, why = [], {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        mod = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        tree = ast.parse(path.read_text(), str(path))
        aliases = {a.asname: a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                   for a in n.names if a.asname}
        for qual, fn in _functions(tree):
            a = fn.args
            params = [p.arg for p in [*a.posonlyargs, *a.args, *a.kwonlyargs]
                      if p.arg in CONFIG_NAMES or (p.annotation is not None and "JobConfig" in ast.unparse(p.annotation))]
            reads = {(n.value.id, n.attr) for n in ast.walk(fn) if isinstance(n, ast.Attribute)
                     and isinstance(n.value, ast.Name) and n.attr in sections}
            held = sorted({n.attr for n in ast.walk(fn) if isinstance(n, ast.Attribute) and n.attr in sections
                           and isinstance(n.value, ast.Attribute) and n.value.attr in HOLDERS
                           and isinstance(n.value.value, ast.Name) and n.value.value.id == "self"})
            name = f"{mod}:{qual}"
            for p in params:
                read = sorted(s for q, s in reads if q == p)
                if read:
                    why[name] = "reads " + ", ".join(f"{p}.{s}" for s in read)
                    break
            else:
                if held:
                    why[name] = "reads " + ", ".join(f"self.<config>.{s}" for s in held)
            calls = {p: set(_calls_with(fn, p, aliases)) for p in params}
            entries.append((name, qual, calls))

    def key_matches(key: str, qual: str) -> bool:
        tail = qual.split(".")
        if key.startswith("."):
            return tail[-1] == key[1:]
        return ".".join(tail[-2:]) == key if "." in key else tail[-1] == key

    changed = True
    while changed:  # whoever hands the config whole to a taker is one too
        changed = False
        takers = [(n, q) for n, q, _ in entries if n in why]
        for name, _, calls in entries:
            if name in why:
                continue
            for p, keys in calls.items():
                hit = next((t for t, tq in takers for k in keys if key_matches(k, tq)), None)
                if hit:
                    why[name] = f"hands {p} whole to {hit}"
                    changed = True
                    break
    return why


def _below_trainer(name: str) -> bool:
    """'verl_hpc.rollout.episodes.build:f' -> True; the top layer's modules, packages and __main__ CLIs -> False."""
    rel = name.split(":")[0].partition(".")[2].replace(".", "/")  # a package's __init__ reads as its folder
    return not ((rel + ".py").startswith(TOP_LAYER) or (rel + "/").startswith(TOP_LAYER)
                or rel.endswith("__main__"))


def test_components_below_the_trainer_take_their_sections():
    found = {n: w for n, w in whole_config_takers(PACKAGE, _job_sections()).items() if _below_trainer(n)}
    new = sorted(set(found) - WHOLE_CONFIG_ALLOWED)
    assert not new, (
        f"{len(found)} functions below the trainer take the whole job config ({len(WHOLE_CONFIG_ALLOWED)} "
        "allowed, in WHOLE_CONFIG_ALLOWED). New ones:\n" + "\n".join(f"  {n}: {found[n]}" for n in new)
        + "\nTake the sections it needs (cfg.rollout, cfg.model, ...) or the values it reads from other "
        "sections as arguments, or a small options object built from the config in the trainer layer; "
        "never add to WHOLE_CONFIG_ALLOWED.")
    gone = sorted(WHOLE_CONFIG_ALLOWED - set(found))
    assert not gone, ("these no longer take the whole job config (or were renamed): take them off "
                      "WHOLE_CONFIG_ALLOWED:\n" + "\n".join(f"  {n}" for n in gone))


def test_the_config_check_sees_a_reader_a_handler_and_a_holder(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "low").mkdir(parents=True)
    (pkg / "low" / "m.py").write_text(
        "from pkg.low.n import g as h\n"
        "def reads(cfg):\n    return cfg.rollout.n\n"
        "def hands(config, x):\n    return reads(config)\n"
        "def via_alias(job_cfg):\n    return h(job_cfg)\n"
        "def sections(rollout, model):\n    return rollout.n + model.path\n"
        "def hf(config):\n    return len(config) + sections(config, 1)\n"
        "def typed(job: 'JobConfig'):\n    return job.data\n"
        "class C:\n    def m(self):\n        return self.cfg.trainer.seed\n"
        "    @classmethod\n    def from_config(cls, cfg):\n        return cls(cfg.model)\n"
        "def via_class(cfg):\n    return C.from_config(cfg)\n")
    (pkg / "low" / "n.py").write_text("def g(cfg):\n    return cfg.data\n")
    found = whole_config_takers(pkg, {"rollout", "model", "data", "trainer"})
    assert sorted(found) == ["pkg.low.m:C.from_config", "pkg.low.m:C.m", "pkg.low.m:hands", "pkg.low.m:reads",
                             "pkg.low.m:typed", "pkg.low.m:via_alias", "pkg.low.m:via_class", "pkg.low.n:g"]
    assert found["pkg.low.m:hands"] == "hands config whole to pkg.low.m:reads"
    assert found["pkg.low.m:reads"] == "reads cfg.rollout"


# rollout/ is laid out by engine, as engines/ is: at its top only the contract, the factory and what
# every engine shares; each engine (vllm/, hf/) and each capability (speculative/, episodes/, tools/,
# agents/) in a folder of its own (docs/architecture.md, "Rollout").
ROLLOUT_TOP = frozenset({
    "__init__",
    "engine",          # the contract (RolloutEngine) and the multi-rank generate every engine shares
    "factory",         # build_rollout, build_judge_engine
    "engine_config",   # RolloutOptions: what an engine is built from
    "sampling",        # SamplingSpec: what to sample
    "result",          # RolloutResult: what generate returns
    "prompts",         # prompt checks and the overflow policy
    "replicas",        # which prompts a rank's replica generates
    "metrics",         # rollout metrics for the tracker
    "weights",         # the checks on a weight-update stream
    "recovery",        # how a failed engine comes back: the fault agreement and bounds every engine's generate uses
})


def loose_modules(folder: Path, allowed) -> list:
    return sorted(p.stem for p in folder.glob("*.py") if p.stem not in allowed)


def test_rollout_top_holds_only_the_contract_the_factory_and_shared_parts():
    loose = loose_modules(PACKAGE / "rollout", ROLLOUT_TOP)
    assert not loose, (f"modules at the top of verl_hpc/rollout/ that belong in a sub-folder (vllm/, hf/, "
                       f"speculative/, episodes/, ... or a new one): {loose}. Only what every engine shares "
                       "stays at the top (ROLLOUT_TOP says why each does)")
    gone = sorted(ROLLOUT_TOP - {p.stem for p in (PACKAGE / "rollout").glob("*.py")})
    assert not gone, f"ROLLOUT_TOP names modules that no longer exist: {gone}"


def test_the_rollout_layout_check_sees_a_loose_module(tmp_path):
    (tmp_path / "engine.py").write_text("")
    (tmp_path / "vllm_thing.py").write_text("")
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "inner.py").write_text("")
    assert loose_modules(tmp_path, ROLLOUT_TOP) == ["vllm_thing"]
