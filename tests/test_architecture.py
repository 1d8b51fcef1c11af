"""The layout's rules, read from the code's own imports and syntax (ast): arrows point down
only, no cycle, protobuf only at the server edges and the client adapters, functions of at most
MAX_FUNCTION_LINES lines (the exceptions listed with their reason), a warning for files past
WARN_FILE_LINES, and a module map in docs/architecture.md that names only paths that exist."""

from __future__ import annotations

import ast
import re
import warnings
from fnmatch import fnmatch
from pathlib import Path
from typing import NamedTuple

import pytest

REPO = Path(__file__).resolve().parents[1]

# Lower layers never import higher ones. Role packages sit side by side: none imports another.
LAYERS = {
    "kvferry_kernels": 0,  # attention kernels and their dispatch
    "kvferry": 1,  # the library core: model, cache, transfer, rpc
    "router": 2,
    "prefill_worker": 2,
    "decode_worker": 2,
    "deploy": 3,  # CLI, launchers, process bootstrap, client, load generator
}
# Inside the core the same rule, a floor per folder: settings and the one-file helpers
# (errors, logs, faults, trace, cores) at the bottom, importing nothing above them.
CORE_LAYERS = {"settings": 0, "cache": 1, "model": 2, "rpc": 3, "transfer": 4}
CORE_LEAVES = ("errors", "logs", "faults", "trace", "cores")
GENERATED = "kvferry/v1/*"
# A package under a source root (a folder on the import path) rather than the repository root.
SOURCE_ROOTS = {"kvferry_kernels": REPO / "kernels"}

# Where protobuf messages may be built or read: the gRPC edges of the servers, the shared RPC
# plumbing, and the client-side adapters that turn them into kvferry's own records.
PROTOBUF_HOMES = (
    "router/server.py", "prefill_worker/server.py", "decode_worker/server.py",
    "kvferry/rpc/*",  # conversions, chunk codec, shared servicer, health, security
    # Each K/V transport's two ends (kvferry/transfer/<name>/): KvTransferService's clients
    # and servers. The transport-neutral modules beside them (sender, sink, wire) hold none.
    "kvferry/transfer/*/*",
    "router/workers/*client.py",  # the router's clients of PrefillService and DecodeService
    "deploy/client.py",  # client of the public GenerationService
    "deploy/loadgen/runner.py",  # the load generator's GenerationService client
)
# Where `grpc` may be imported: the edges (servers, the public status mapping, the command
# line and process start-up) and the adapters that call other processes. Past the adapters a
# failed call is a `kvferry.errors` class (`kvferry.rpc.grpc_util.from_rpc`): nothing in the
# router's request flow, the engines or the cache reads a status code.
GRPC_HOMES = (
    *PROTOBUF_HOMES,
    "kvferry/transfer/*",  # the K/V transports' ends, and the registry that adds them
    "router/public_errors.py", "router/http/errors.py",  # the public statuses
    "router/http/front.py",  # the HTTP edge (statuses named for the failure metrics)
    "deploy/*",  # the command line: public-API clients, servers started in processes
    "decode_worker/build.py", "prefill_worker/build.py",  # a role adds its gRPC services
)
# Files are sized by what they hold: past this many lines a file gets a warning to look at,
# not a failure. Functions fail past MAX_FUNCTION_LINES, but for those listed with a reason.
WARN_FILE_LINES = 400
MAX_FUNCTION_LINES = 60
LONG_FUNCTIONS = {
    "kernels/kvferry_kernels/triton_paged_attention.py::_decode_stage1_kernel":
        "a Triton kernel: one program's loop over its pages, which Triton compiles whole",
    "kernels/kvferry_kernels/triton_paged_attention.py::paged_decode_attention_triton":
        "the launch of those kernels: their argument lists, one argument a line",
    "kernels/kvferry_kernels/triton_kv_append.py::_write_kv_kernel":
        "a Triton kernel: one program's quantize-and-store, which Triton compiles whole",
    "deploy/args.py::build_parser": "an argument-parser table: one flag after another",
    "deploy/loadgen/cli.py::add_arguments": "an argument-parser table: one flag after another",
}


class Import(NamedTuple):
    importer: str  # module name
    target: str  # module name (or package.name for `from package import name`)
    line: int


def _root(path: Path) -> Path:
    return next((root for root in SOURCE_ROOTS.values() if path.is_relative_to(root)), REPO)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(_root(path)).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _sources() -> dict[str, Path]:
    found = {}
    for package in LAYERS:
        for path in sorted((SOURCE_ROOTS.get(package, REPO) / package).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            if not fnmatch(rel, GENERATED):
                found[_module_name(path)] = path
    return found


def _imports(name: str, path: Path) -> list[Import]:
    """Every import of the module, at any depth (inside functions too: a lazy import is
    still an arrow)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [Import(name, alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found += [Import(name, f"{base}.{alias.name}", node.lineno) for alias in node.names]
            found.append(Import(name, base, node.lineno))
    return found


SOURCES = _sources()
IMPORTS = {name: _imports(name, path) for name, path in SOURCES.items()}


def _resolve(target: str) -> str | None:
    """The project module an import names (`from pkg import mod` names pkg.mod)."""
    while target:
        if target in SOURCES:
            return target
        target = target.rpartition(".")[0]
    return None


def _rel(name: str) -> str:
    return SOURCES[name].relative_to(REPO).as_posix()


def test_the_walk_sees_every_package() -> None:
    tops = {name.split(".")[0] for name in SOURCES}
    assert tops == set(LAYERS)
    assert len(SOURCES) > 50


def test_no_import_points_upward_or_sideways() -> None:
    bad = []
    for name, imports in IMPORTS.items():
        top = name.split(".")[0]
        for imp in imports:
            target = _resolve(imp.target)
            if target is None:
                continue
            other = target.split(".")[0]
            if other == top:
                continue
            if LAYERS[other] >= LAYERS[top]:
                bad.append(f"{_rel(name)}:{imp.line} imports {target}")
    assert bad == []


def _core_floor(module: str) -> int | None:
    """The floor of a module of kvferry/ (None: the generated protobuf, or the package itself)."""
    parts = module.split(".")
    if parts[0] != "kvferry" or len(parts) < 2 or parts[1] == "v1":
        return None
    if parts[1] in CORE_LEAVES:
        return 0
    return CORE_LAYERS[parts[1]]


def upward_core_imports(imports: dict[str, list[Import]]) -> list[str]:
    """`path:line imports target` of every import inside kvferry/ to a higher floor."""
    bad = []
    for name, found in imports.items():
        floor = _core_floor(name)
        if floor is None:
            continue
        for imp in found:
            target = _resolve(imp.target) or imp.target
            other = _core_floor(target)
            if other is not None and other > floor:
                bad.append(f"{_rel(name)}:{imp.line} imports {target}")
    return bad


def test_every_core_module_has_a_floor() -> None:
    tops = {name.split(".")[1] for name in SOURCES if name.startswith("kvferry.")}
    assert tops - {"v1"} == set(CORE_LAYERS) | set(CORE_LEAVES)


def test_no_import_inside_the_core_points_up_a_floor() -> None:
    assert upward_core_imports(IMPORTS) == []


def test_the_floor_rule_finds_a_planted_import() -> None:
    planted = {"kvferry.settings": [Import("kvferry.settings", "kvferry.transfer.transport", 9)],
               "kvferry.model.sampling": [Import("kvferry.model.sampling", "kvferry.settings", 3)]}
    assert upward_core_imports(planted) == [
        "kvferry/settings/__init__.py:9 imports kvferry.transfer.transport"]


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {name: set() for name in SOURCES}
    for name, imports in IMPORTS.items():
        for imp in imports:
            target = _resolve(imp.target)
            if target is not None and target != name and not _is_package_of(target, name):
                graph[name].add(target)
    return graph


def _is_package_of(package: str, module: str) -> bool:
    """`from kvferry.rpc import convert` inside kvferry/rpc/x.py names the package first."""
    return module.startswith(package + ".") and SOURCES[package].name == "__init__.py"


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_cycle() -> None:
    assert _cycles(_graph()) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]


def test_protobuf_only_at_edges_and_client_adapters() -> None:
    bad = []
    for name, imports in IMPORTS.items():
        rel = _rel(name)
        if any(fnmatch(rel, home) for home in PROTOBUF_HOMES):
            continue
        for imp in imports:
            leaf = imp.target.rpartition(".")[2]
            if re.search(r"_pb2(_grpc)?$", leaf):
                bad.append(f"{rel}:{imp.line} imports {imp.target}")
    assert bad == []


def grpc_outside_homes(imports: dict[str, list[Import]]) -> list[str]:
    """`path:line` of every import of grpc (or its health, reflection and tools packages)
    outside GRPC_HOMES."""
    bad = []
    for name, found in imports.items():
        rel = _rel(name)
        if any(fnmatch(rel, home) for home in GRPC_HOMES):
            continue
        bad += [f"{rel}:{imp.line} imports {imp.target}" for imp in found
                if imp.target == "grpc" or imp.target.startswith(("grpc.", "grpc_"))]
    return bad


def test_grpc_only_at_edges_and_adapters() -> None:
    assert grpc_outside_homes(IMPORTS) == []


def test_the_grpc_rule_finds_a_planted_import() -> None:
    planted = {"router.engine": [Import("router.engine", "grpc", 12)],
               "decode_worker.steps": [Import("decode_worker.steps", "grpc_health.v1", 3)]}
    assert grpc_outside_homes(planted) == ["router/engine.py:12 imports grpc",
                                           "decode_worker/steps.py:3 imports grpc_health.v1"]


def test_long_files_are_flagged_not_failed() -> None:
    """A file past WARN_FILE_LINES gets a warning naming it (split it where its parts hold
    different things, not to meet a number)."""
    for path in SOURCES.values():
        lines = len(path.read_text().splitlines())
        if lines > WARN_FILE_LINES:
            rel = path.relative_to(REPO).as_posix()
            warnings.warn(f"{rel}: {lines} lines (past {WARN_FILE_LINES})", stacklevel=1)


def long_functions(sources: dict[str, Path], limit: int = MAX_FUNCTION_LINES) -> dict[str, int]:
    """`path::name` of every function (methods and nested ones too) longer than `limit`
    lines, decorators excluded, with its length."""
    found = {}
    for path in sources.values():
        rel = path.relative_to(REPO).as_posix() if path.is_relative_to(REPO) else path.name
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > limit:
                    found[f"{rel}::{node.name}"] = length
    return found


def test_the_length_rule_finds_a_long_method(tmp_path: Path) -> None:
    body = "".join(f"        x{i} = {i}\n" for i in range(60))
    planted = tmp_path / "planted.py"
    planted.write_text(f"class A:\n    def long(self) -> None:\n{body}\n    def short(self):\n"
                       "        pass\n")
    assert {k.split("::")[1]: n for k, n in long_functions({"p": planted}).items()} == {
        "long": 61}


def test_functions_stay_short() -> None:
    found = long_functions(SOURCES)
    assert {name: n for name, n in found.items() if name not in LONG_FUNCTIONS} == {}
    assert sorted(set(LONG_FUNCTIONS) - set(found)) == []  # no exception outlives its reason


def _doc_paths() -> list[str]:
    text = (REPO / "docs" / "architecture.md").read_text()
    spans = re.findall(r"`([^`\s]+)`", text)
    paths = []
    for span in spans:
        for part in re.split(r",\s*", span):
            if re.fullmatch(r"[\w.-]+(/[\w.*-]+)+/?", part):  # a path with a folder
                paths.append(part)
    return paths


def test_the_module_map_names_only_paths_that_exist() -> None:
    paths = _doc_paths()
    assert len(paths) > 30  # the map is there, and read
    missing = [p for p in paths if not list(REPO.glob(p.rstrip("/")))]
    assert missing == []


@pytest.mark.parametrize("package", sorted(LAYERS))
def test_the_module_map_names_every_package(package: str) -> None:
    folder = (SOURCE_ROOTS.get(package, REPO) / package).relative_to(REPO).as_posix()
    assert any(p.startswith(f"{folder}/") for p in _doc_paths()), package
