"""The engine's import graph: no cycles, no import from a lower layer to a higher one, no torch in the pure
Python core, and nothing of the server. Read from the source (module-level and function-level imports; those
under `if TYPE_CHECKING:` are annotations only and do not count)."""
from __future__ import annotations

import ast
from pathlib import Path

ENGINE = Path(__file__).resolve().parents[2] / "engine"

# Lower numbers are lower layers; a module imports only its own layer or below.
LAYERS = {
    # types and settings
    "engine.config": 0, "engine.sampling_params": 0, "engine.sequence": 0, "engine.memory": 0, "engine.openmp": 0,
    # pure Python over ints: blocks, queues, the step's decision, the boundaries' types
    "engine.block_allocator": 1, "engine.prompt_logprobs": 1, "engine.block_manager": 1, "engine.scheduler": 1,
    "engine.detokenizer": 1, "engine.faults": 1, "engine.protocol": 1, "engine.metrics": 1,
    # tensors: kernels, the model, the cache, the forward, sampling, outputs
    "engine.ops_loader": 2, "engine.ref_ops": 2, "engine.ops": 2, "engine.attention": 2, "engine.prefill_kernels": 2,
    "engine.cpu_linear": 2,
    "engine.models": 2, "engine.models.llama": 2, "engine.models.llama_args": 2, "engine.models.llama_weights": 2,
    "engine.models.compiled_decode": 2,
    "engine.loader": 2,
    "engine.cache_engine": 2,
    "engine.distributed": 2, "engine.model_runner": 2, "engine.worker": 2, "engine.tp_workers": 2,
    "engine.logits_transforms": 2, "engine.structured": 2, "engine.sampler": 2, "engine.output_processor": 2,
    # the engine, then its fronts
    "engine.llm_engine": 3, "engine.async_engine": 4, "engine.llm": 4, "engine": 5,
}
PURE_PYTHON = [m for m, layer in LAYERS.items() if layer <= 1]


def _module_name(path: Path) -> str:
    parts = path.relative_to(ENGINE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST) -> set[str]:
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in ENGINE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        imported = _imports(ast.parse(path.read_text()))
        # `from engine import ops` names engine.ops; the package itself (its __init__ runs first for any
        # engine.x, importing only layer 0) is not a dependency.
        graph[name] = {m for m in imported if m in modules and m not in (name, "engine")}
        graph[name] |= {m for m in imported if m == "torch" or m.startswith("server")}
    return graph


def test_every_engine_module_has_a_layer():
    assert sorted(set(_graph()) - set(LAYERS)) == []


def test_no_import_goes_up_a_layer_or_into_the_server():
    graph = _graph()
    upward = [f"{m} -> {dep}" for m, deps in graph.items() for dep in deps
              if dep.startswith("server") or (dep in LAYERS and m in LAYERS and LAYERS[dep] > LAYERS[m])]
    assert upward == []


def test_no_cycles():
    graph = {m: {d for d in deps if d.startswith("engine")} for m, deps in _graph().items()}
    state: dict[str, int] = {}
    cycles = []

    def walk(node: str, path: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                cycles.append(" -> ".join(path[path.index(dep):] + [dep]))
            elif dep not in state:
                walk(dep, path + [dep])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            walk(module, [module])
    assert cycles == []


def test_the_pure_python_core_never_reaches_torch():
    graph = _graph()

    def reaches_torch(module: str, seen: set[str]) -> bool:
        if module == "torch":
            return True
        seen.add(module)
        return any(reaches_torch(dep, seen) for dep in graph.get(module, ()) if dep not in seen)

    assert [m for m in PURE_PYTHON if reaches_torch(m, set())] == []
