"""The layering of docs/architecture.md, checked on the source: imports only point down.

Every module of ``src/mixprec`` belongs to one level of ``LEVELS`` (longest prefix wins).
A module may import its own component (the same package or module) and any component of
a lower level; never a higher level, never another component of its own level, and never
another module's underscore names. Function-level imports count too. The module graph
has no cycles.
"""

from __future__ import annotations

import ast
import pathlib
from collections.abc import Iterator

import pytest

SRC = pathlib.Path(__file__).resolve().parents[1] / "src"

# Bottom to top. Components on one level are peers: they must not import each other.
LEVELS: list[tuple[str, tuple[str, ...]]] = [
    ("foundation", ("mixprec.nested", "mixprec.formatting", "mixprec.process_groups", "mixprec.compiling",
                    "mixprec.startup", "mixprec.lagged")),
    ("dtypes", ("mixprec.dtypes",)),
    ("hardware", ("mixprec.hardware",)),
    ("formats", ("mixprec.fp8.formats",)),
    ("policy", ("mixprec.policy",)),
    ("autocast", ("mixprec.amp",)),
    ("inputs", ("mixprec.inputs",)),
    ("autocast tools", ("mixprec.islands", "mixprec.stats")),
    ("numerics", ("mixprec.scaling", "mixprec.optim", "mixprec.fp8", "mixprec.buffers", "mixprec.tracing")),
    ("plans", ("mixprec.plans",)),
    ("distributed", ("mixprec.distributed",)),
    ("prepare", ("mixprec.prepare",)),
    ("step state", ("mixprec.ledger", "mixprec.phases", "mixprec.explainer")),
    ("step", ("mixprec.step", "mixprec.options")),
    ("resume", ("mixprec.resume",)),
    ("composable", ("mixprec.composable",)),
    ("stepping", ("mixprec.stepping",)),
    ("session", ("mixprec.session",)),
    ("diagnostics", ("mixprec.diagnostics", "mixprec.graphs")),
    ("checkpoint", ("mixprec.checkpoint",)),
    ("package", ("mixprec",)),
    ("applications", ("mixprec.integrations", "mixprec.cli")),
    ("entry point", ("mixprec.__main__",)),
]


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in sorted((SRC / "mixprec").rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _component(module: str) -> tuple[int, str]:
    """(level index, component prefix) of ``module``: the longest matching prefix."""
    best: tuple[int, str] | None = None
    for index, (_, prefixes) in enumerate(LEVELS):
        for prefix in prefixes:
            nested = module.startswith(prefix + ".") and prefix != "mixprec"  # the root package is only itself
            if (module == prefix or nested) and (best is None or len(prefix) > len(best[1])):
                best = (index, prefix)
    if best is None:
        raise AssertionError(f"module {module} is in no level of LEVELS; add it to tests/test_architecture.py")
    return best


def _imports(module: str, path: pathlib.Path) -> Iterator[tuple[str, list[str], int]]:
    """(imported module, imported names, line) for every mixprec import in ``path``."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "mixprec":
                    yield alias.name, [], node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "mixprec":
                continue
            names = [a.name for a in node.names]
            submodules = [f"{target}.{n}" for n in names if f"{target}.{n}" in MODULES]
            if submodules:  # `from mixprec import distributed` imports the module mixprec.distributed
                yield from ((sub, [], node.lineno) for sub in submodules)
                names = [n for n in names if f"{target}.{n}" not in MODULES]
                if not names:
                    continue
            yield target, names, node.lineno


EDGES = [(m, target, names, line) for m, path in MODULES.items() for target, names, line in _imports(m, path)]


def test_every_module_has_a_level() -> None:
    for module in MODULES:
        _component(module)


Edge = tuple[str, str, list[str], int]


def _layer_problems(edges: list[Edge]) -> list[str]:
    problems = []
    for module, target, _, line in edges:
        (src_level, src_comp), (dst_level, dst_comp) = _component(module), _component(target)
        if src_comp == dst_comp:
            continue
        if dst_level > src_level:
            problems.append(
                f"{module}:{line} imports {target}: {LEVELS[src_level][0]} -> {LEVELS[dst_level][0]} points up"
            )
        elif dst_level == src_level:
            problems.append(f"{module}:{line} imports {target}: peers on level {LEVELS[src_level][0]!r}")
    return problems


def _private_problems(edges: list[Edge]) -> list[str]:
    problems = []
    for module, target, names, line in edges:
        private = [n for n in names if n.startswith("_") and not n.startswith("__")]
        if private and target != module:
            problems.append(f"{module}:{line} imports {', '.join(private)} from {target}")
        hidden = [p for p in target.split(".")[1:] if p.startswith("_") and not p.startswith("__")]
        if hidden and _component(module)[1] != _component(target)[1]:
            problems.append(f"{module}:{line} imports the private module {target} of another component")
    return problems


def test_imports_point_down_the_layers() -> None:
    problems = _layer_problems(EDGES)
    assert not problems, "\n".join(problems)


def test_no_module_imports_another_modules_private_names() -> None:
    problems = _private_problems(EDGES)
    assert not problems, "\n".join(problems)


def test_the_module_graph_has_no_cycle() -> None:
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for module, target, _, _ in EDGES:
        if target in MODULES and target != module and not module.startswith(target + "."):
            graph[module].add(target)
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = [*stack[stack.index(nxt):], nxt]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)


def test_the_checkers_name_each_kind_of_bad_import() -> None:
    """The rules are not vacuous: synthetic bad edges are each reported, good ones are not."""
    assert _layer_problems([("mixprec.scaling.base", "mixprec.session", [], 1)]) == [
        "mixprec.scaling.base:1 imports mixprec.session: numerics -> session points up"
    ]
    assert _layer_problems([("mixprec.optim.base", "mixprec.scaling", [], 2)]) == [
        "mixprec.optim.base:2 imports mixprec.scaling: peers on level 'numerics'"
    ]
    assert _layer_problems([("mixprec.session", "mixprec.step", [], 3)]) == []
    assert _private_problems([("mixprec.session", "mixprec.step", ["_hidden"], 4)]) == [
        "mixprec.session:4 imports _hidden from mixprec.step"
    ]
    assert _private_problems([("mixprec.cli.demo", "mixprec.scaling._checks", ["show"], 5)]) == [
        "mixprec.cli.demo:5 imports the private module mixprec.scaling._checks of another component"
    ]
    assert any(target == "mixprec.session" for _, target, _, _ in EDGES), "the edges were not collected"


def test_the_architecture_document_lists_every_level() -> None:
    """docs/architecture.md and LEVELS are the same list: each level and component is in the table."""
    doc = (SRC.parent / "docs" / "architecture.md").read_text()
    rows = {line.split("|")[1].strip(): line for line in doc.splitlines() if line.startswith("| ") and "---" not in line}
    for name, components in LEVELS:
        assert name in rows, f"level {name!r} has no row in docs/architecture.md"
        for component in components:
            assert f"`{component}`" in rows[name], f"{component} is missing from the {name!r} row of docs/architecture.md"
    assert len(rows) - 1 == len(LEVELS), "docs/architecture.md has a level that tests/test_architecture.py does not"


# ------------------------------------------------------------ the optim/ room (issue: one undo, one validator)
OPTIM = SRC / "mixprec" / "optim"
SNAPSHOT_MODULE = OPTIM / "snapshot.py"
VALIDATOR_MODULE = OPTIM / "checks.py"
_RESTORING_NAMES = ("restore", "undo", "rollback", "snapshot")
_WRITES = ("copy_", "_foreach_copy_", "_foreach_add_", "_foreach_sub_", "sub_", "set_", "pop", "clear", "update")


def _functions(tree: ast.AST) -> Iterator[ast.FunctionDef | ast.AsyncFunctionDef]:
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node


def _state_writes(node: ast.AST) -> list[int]:
    """Lines of ``node`` that write optimizer-owned state back: a copy into a tensor, a
    ``.state[...] =`` / ``.state.pop``, or an assignment of ``.state`` / ``.param_groups``."""
    lines = []
    for sub in ast.walk(node):
        if isinstance(sub, ast.Call) and isinstance(sub.func, ast.Attribute) and sub.func.attr in _WRITES:
            owner = sub.func.value
            if sub.func.attr != "pop" or (isinstance(owner, ast.Attribute) and owner.attr == "state"):
                lines.append(sub.lineno)
        targets = sub.targets if isinstance(sub, ast.Assign) else []
        for t in targets:
            if isinstance(t, ast.Subscript) and isinstance(t.value, ast.Attribute) and t.value.attr == "state":
                lines.append(sub.lineno)
            if isinstance(t, ast.Attribute) and t.attr in ("state", "param_groups"):
                lines.append(sub.lineno)
            if isinstance(t, ast.Tuple) and any(
                isinstance(e, ast.Attribute) and e.attr in ("state", "param_groups") for e in t.elts
            ):
                lines.append(sub.lineno)
    return lines


def _undo_problems(paths: list[pathlib.Path]) -> list[str]:
    """Code outside the snapshot module that puts optimizer state back itself: a function
    named like an undo that writes state, or an exception handler that writes it back."""
    problems = []
    for path in paths:
        if path == SNAPSHOT_MODULE:
            continue
        tree = ast.parse(path.read_text(), str(path))
        for fn in _functions(tree):
            if any(word in fn.name.lower() for word in _RESTORING_NAMES):
                problems += [f"{path.name}:{line} {fn.name} writes state back itself" for line in _state_writes(fn)]
        for node in ast.walk(tree):
            if isinstance(node, ast.ExceptHandler):
                problems += [f"{path.name}:{line} an except handler puts state back" for line in _state_writes(node)]
    return problems


def _validator_problems(paths: list[pathlib.Path]) -> list[str]:
    """Code outside the validator module that checks an optimizer state_dict itself: a
    ``split_*_state`` function, a ``check_*`` / ``validate*`` one of a state (its name or an
    argument says state, master, kind or saved), or a ``load_state_dict`` that raises its own refusal (re-raising is fine)."""
    problems = []
    for path in paths:
        if path == VALIDATOR_MODULE:
            continue
        for fn in _functions(ast.parse(path.read_text(), str(path))):
            name = fn.name.lstrip("_")
            words = [name] + [a.arg for a in fn.args.args + fn.args.kwonlyargs]
            about_state = any(w in word for word in words for w in ("state", "master", "kind", "saved"))
            splits = name.startswith("split_") and name.endswith("_state")
            refuses = any(isinstance(sub, ast.Raise) and sub.exc is not None for sub in ast.walk(fn))
            if (splits or (name.startswith(("check_", "validate")) and about_state)) and refuses:
                problems.append(f"{path.name}:{fn.lineno} defines the validator {fn.name}")
            if fn.name == "load_state_dict":
                for sub in ast.walk(fn):
                    if isinstance(sub, ast.Raise) and sub.exc is not None:
                        problems.append(f"{path.name}:{sub.lineno} load_state_dict raises its own refusal")
    return problems


def test_only_the_snapshot_module_restores_optimizer_state() -> None:
    assert _undo_problems(sorted(OPTIM.glob("*.py"))) == []


def test_only_the_validator_module_validates_optimizer_state_dicts() -> None:
    assert _validator_problems(sorted(OPTIM.glob("*.py"))) == []


def test_the_optim_room_checkers_catch_a_second_copy(tmp_path: pathlib.Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text(
        "def undo_step(self):\n"
        "    self.param.copy_(self.saved)\n"
        "def load(self, opt, sd):\n"
        "    old = opt.state\n"
        "    try:\n"
        "        opt.load_state_dict(sd)\n"
        "    except Exception:\n"
        "        opt.state, opt.param_groups = old, []\n"
        "        raise\n"
        "def check_masters(sd):\n"
        "    raise ValueError('no masters')\n"
        "def check_state_dict(self, sd):\n"
        "    return check_masters(sd)\n"
        "class W:\n"
        "    def load_state_dict(self, sd):\n"
        "        raise ValueError('no')\n"
    )
    assert [p.split(" ", 1)[1] for p in _undo_problems([bad])] == [
        "undo_step writes state back itself", "an except handler puts state back",
    ]
    assert [p.split(" ", 1)[1] for p in _validator_problems([bad])] == [
        "defines the validator check_masters", "load_state_dict raises its own refusal",
    ]


# ------------------------------------------- the optim/ room: one rule, one set of codecs, one route decision
RULE_MODULE = OPTIM / "rule.py"
#: the codecs (:mod:`mixprec.optim.codecs`) and the byte layouts they are built on
CODEC_MODULES = (OPTIM / "codecs.py", OPTIM / "states.py", OPTIM / "quant.py")
ROUTE_MODULE = OPTIM / "routing.py"
#: the sanctioned mirrors of the rule in another language, held to it by their tests (a GPU
#: kernel file joins them by name); Python modules binding them are not mirrors
RULE_MIRRORS = ("native_adam.c", "_triton_adam_kernels.py")
_UPDATE_CALLS = ("lerp", "lerp_", "addcmul", "addcmul_", "addcdiv", "addcdiv_",
                 "_foreach_lerp", "_foreach_lerp_", "_foreach_addcmul", "_foreach_addcmul_",
                 "_foreach_addcdiv", "_foreach_addcdiv_")
_CODEC_CALLS = ("join_master", "split_master", "split_master_into", "quantize_blockwise", "quantize_blockwise_into",
                "quantize_flat", "dequantize_blockwise", "expand_pieces", "store_pieces", "randint")
_BIT_VIEWS = ("int32", "int16", "int8", "uint8", "float32", "bfloat16", "float16")
_ROUTE_CALLS = ("use_compiled_route", "use_native_route", "use_triton_route", "kernel_works", "compiles_param",
                "takes_param", "takes")


def _called(node: ast.Call) -> str:
    return node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id if isinstance(node.func, ast.Name) else ""


def _room_problems(paths: list[pathlib.Path]) -> list[str]:
    """Update arithmetic or a bias correction outside the rule module, a conversion of a stored
    form (a bit-format primitive, a reinterpreting ``.view(torch.<int or float dtype>)``, rounding
    noise) outside the codec modules, a route decision outside the routing module (an executor
    module may compose the predicates it defines, what it takes; only routing asks them)."""
    problems: list[tuple[str, int, str]] = []
    for path in paths:
        tree = ast.parse(path.read_text(), str(path))
        own = {fn.name for fn in tree.body if isinstance(fn, ast.FunctionDef)}  # an executor's own predicates
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                name = _called(node)
                if name in _UPDATE_CALLS and path != RULE_MODULE:
                    problems.append((path.name, node.lineno, f"writes update arithmetic ({name})"))
                if path not in CODEC_MODULES and (
                    name in _CODEC_CALLS or (name == "view" and any(
                        isinstance(a, ast.Attribute) and a.attr in _BIT_VIEWS for a in node.args))
                ):
                    problems.append((path.name, node.lineno, f"converts a stored form itself ({name})"))
                if name in _ROUTE_CALLS and path != ROUTE_MODULE and name not in own:
                    problems.append((path.name, node.lineno, f"decides a route ({name})"))
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow) and path != RULE_MODULE:
                base = ast.unparse(node.left)
                if "beta" in base.lower():
                    problems.append((path.name, node.lineno, f"writes a bias correction ({ast.unparse(node)})"))
    return [f"{name}:{line} {what}" for name, line, what in sorted(problems)]


def test_the_rule_codecs_and_route_decision_are_each_written_once() -> None:
    assert _room_problems(sorted(OPTIM.glob("*.py"))) == []
    assert RULE_MODULE.exists() and all(p.exists() for p in CODEC_MODULES) and ROUTE_MODULE.exists()
    for mirror in RULE_MIRRORS:
        assert (OPTIM / mirror).exists(), f"the sanctioned mirror {mirror} is gone: drop it from RULE_MIRRORS"
    # each mirror names the rule's operations in its order (torch's Adam), so a change to one is seen in the others
    for mirror in RULE_MIRRORS:
        text = (OPTIM / mirror).read_text()
        assert all(op in text for op in ("lerp_(grad", "addcmul_(grad", "addcdiv_(exp_avg")), f"{mirror} no longer cites the rule"


#: the modules that may name a block-coded state form itself (``states.Q8``, ``states.FP8``): its codec
#: module, and the native and Triton kernels with their bindings, which step the 8-bit form only (the
#: kernels being sanctioned mirrors of its codec); everything else reads the forms from
#: ``states.BLOCKWISE``, so a new form is one codec there (plus its tests)
FORM_NAMERS = ("states.py", "native.py", "triton_adam.py", "_triton_adam_kernels.py")


def _form_problems(paths: list[pathlib.Path]) -> list[str]:
    problems = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else None
            if name in ("Q8", "FP8") and path.name not in FORM_NAMERS:
                problems.append(f"{path.name}:{node.lineno} names the state form {name} (ask states.block_codec)")
    return problems


def test_only_the_codec_module_names_a_block_coded_state_form(tmp_path: pathlib.Path) -> None:
    assert _form_problems([*sorted(OPTIM.glob("*.py")), SRC / "mixprec" / "resume.py"]) == []
    bad = tmp_path / "bad.py"
    bad.write_text("from mixprec.optim import states\nif dtype == states.Q8:\n    pass\n")
    assert _form_problems([bad]) == ["bad.py:2 names the state form Q8 (ask states.block_codec)"]


def test_the_room_checker_catches_a_second_rule_codec_or_route(tmp_path: pathlib.Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import torch\n"
        "def step(m, g, v, w, beta1, step, opt):\n"
        "    m.lerp_(g, 0.1)\n"
        "    torch._foreach_addcdiv_([w], [m], [v], value=-1.0)\n"
        "    c = 1 - beta1 ** step\n"
        "    bits = w.view(torch.int32)\n"
        "    noise = torch.randint(0, 1 << 16, w.shape)\n"
        "    return use_compiled_route(opt.compile, 'kahan', [w])\n"
    )
    assert [p.split(" ", 1)[1] for p in _room_problems([bad])] == [
        "writes update arithmetic (lerp_)",
        "writes update arithmetic (_foreach_addcdiv_)",
        "writes a bias correction (beta1 ** step)",
        "converts a stored form itself (view)",
        "converts a stored form itself (randint)",
        "decides a route (use_compiled_route)",
    ]


def test_no_module_is_over_450_lines() -> None:
    """Each module holds one idea: none in src/ is over 450 lines."""
    long = {str(p.relative_to(SRC)): n for p in sorted(SRC.rglob("*.py")) if (n := len(p.read_text().splitlines())) > 450}
    assert not long, long
