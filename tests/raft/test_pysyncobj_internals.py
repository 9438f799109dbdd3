"""``lighthouse_cluster.raft.pysyncobj_internals``: pysyncobj pinned, every private name it uses checked.

The check passes on the installed (pinned) pysyncobj and names what is missing otherwise: a copy
of a pysyncobj module with one name removed or renamed, or another version, is handed to the
check in place of the real one (no processes, pysyncobj itself untouched). The source tests hold
the rule that makes the check complete: only ``lighthouse_cluster.raft`` imports pysyncobj, only
``pysyncobj_internals`` reaches past its public API, and every private pysyncobj name the
package's code touches is in ``INTERNALS``.
"""

from __future__ import annotations

import ast
import dis
import importlib
import importlib.metadata
import inspect
import re
import sys
import tomllib
import types
from pathlib import Path
from typing import Any

import pysyncobj
import pytest

from lighthouse_cluster.raft import pysyncobj_internals as internals

REPO = Path(__file__).resolve().parents[2]
RAFT = REPO / "lighthouse_cluster" / "raft"


def importer(**replaced: Any):  # type: ignore[no-untyped-def]
    """``import_module`` that returns ``replaced[name]`` (``None``: ImportError) for some modules."""
    def import_module(name: str) -> Any:
        key = name.replace(".", "_")
        if key in replaced:
            if replaced[key] is None:
                raise ModuleNotFoundError(f"No module named {name!r}")
            return replaced[key]
        return importlib.import_module(name)
    return import_module


def module_copy(name: str, **changes: Any) -> types.SimpleNamespace:
    return types.SimpleNamespace(**{**vars(importlib.import_module(name)), **changes})


def class_copy(cls: type, drop: tuple[str, ...] = (), **changes: Any) -> type:
    """``cls`` again, without the attributes ``drop`` and with ``changes``."""
    body = {k: v for k, v in vars(cls).items() if k not in drop and k not in ("__dict__", "__weakref__")}
    return type(cls.__name__, cls.__bases__, {**body, **changes})


def init_renaming(cls: type, old: str, new: str) -> Any:
    """``cls.__init__`` as if pysyncobj had renamed the attribute ``old`` to ``new``."""
    init = cls.__dict__["__init__"]
    code = init.__code__.replace(co_names=tuple(new if n == old else n for n in init.__code__.co_names))
    return types.FunctionType(code, init.__globals__, init.__name__, init.__defaults__, init.__closure__)


def failure(import_module: Any) -> str:
    with pytest.raises(ImportError) as e:
        internals.check(import_module)
    text = str(e.value)
    assert "\n" not in text and f"pip install pysyncobj=={internals.PINNED_VERSION}" in text
    return text


# -- the installed version ---------------------------------------------------------------------------


def test_the_installed_pysyncobj_is_the_pinned_version_with_every_internal() -> None:
    assert internals.problems() == (internals.PINNED_VERSION, [])
    internals.check()
    assert importlib.metadata.version("pysyncobj") == internals.PINNED_VERSION
    assert len(internals.INTERNALS) == len(set(internals.INTERNALS))


def test_pyproject_pins_the_checked_version() -> None:
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    assert [d for d in deps if d.startswith("pysyncobj")] == [f"pysyncobj=={internals.PINNED_VERSION}"]


# -- what a changed pysyncobj looks like -------------------------------------------------------------


def test_a_missing_private_method_is_named() -> None:
    syncobj = importlib.import_module("pysyncobj.syncobj")
    fake = module_copy("pysyncobj.syncobj",
                       SyncObj=class_copy(syncobj.SyncObj, drop=("_SyncObj__generateRaftTimeout",)))
    text = failure(importer(pysyncobj_syncobj=fake))
    assert text == ("lighthouse_cluster.raft needs pysyncobj==0.3.17 (it uses that version's private internals), "
                    "but pysyncobj 0.3.17 is installed; missing: "
                    "pysyncobj.syncobj.SyncObj._SyncObj__generateRaftTimeout; run: pip install pysyncobj==0.3.17")


def test_a_renamed_instance_attribute_is_named() -> None:
    syncobj = importlib.import_module("pysyncobj.syncobj")
    cls = syncobj.SyncObj
    fake = module_copy("pysyncobj.syncobj", SyncObj=class_copy(
        cls, __init__=init_renaming(cls, "_SyncObj__raftElectionDeadline", "_SyncObj__electionDeadline")))
    assert internals.problems(importer(pysyncobj_syncobj=fake))[1] == [
        "pysyncobj.syncobj.SyncObj._SyncObj__raftElectionDeadline"]
    tcp = importlib.import_module("pysyncobj.tcp_connection")
    conn = tcp.TcpConnection
    fake_tcp = module_copy("pysyncobj.tcp_connection", TcpConnection=class_copy(
        conn, __init__=init_renaming(conn, "_TcpConnection__lastReadTime", "_TcpConnection__lastRead")))
    assert "pysyncobj.tcp_connection.TcpConnection._TcpConnection__lastReadTime" in failure(
        importer(pysyncobj_tcp_connection=fake_tcp))


def test_stored_attributes_from_the_raw_bytecode_match_dis_on_every_pysyncobj_function() -> None:
    """The check reads STORE_ATTR names from the bytecode itself (fast); ``dis`` is the reference,
    on every function and method of pysyncobj's modules, and on a function whose attribute name
    needs an EXTENDED_ARG (more than 255 names before it)."""
    checked = 0
    for name in ("syncobj", "tcp_connection", "transport", "journal", "node", "poller", "serializer"):
        module = importlib.import_module(f"pysyncobj.{name}")
        for obj in vars(module).values():
            functions = [f for f in vars(obj).values() if inspect.isfunction(f)] if inspect.isclass(obj) \
                else [obj] if inspect.isfunction(obj) else []
            for function in functions:
                expected = {i.argval for i in dis.get_instructions(function) if i.opname == "STORE_ATTR"}
                assert internals._stored_attributes(function) == expected, function
                checked += 1
    assert checked > 200
    namespace: dict[str, Any] = {}
    body = "".join(f"    x.a{i} = 1\n" for i in range(300))
    exec(f"def many(x):\n{body}", namespace)  # noqa: S102 -- a generated function, no input
    assert internals._stored_attributes(namespace["many"]) == {f"a{i}" for i in range(300)}


def test_an_overridden_method_with_other_parameters_is_named() -> None:
    syncobj = importlib.import_module("pysyncobj.syncobj")
    fake = module_copy("pysyncobj.syncobj", SyncObj=class_copy(syncobj.SyncObj, _onTick=lambda self: None))
    assert internals.problems(importer(pysyncobj_syncobj=fake))[1] == ["pysyncobj.syncobj.SyncObj._onTick"]


def test_missing_module_level_names_and_modules_are_named() -> None:
    fake = module_copy("pysyncobj.syncobj")
    del fake._RAFT_STATE
    version, missing = internals.problems(importer(pysyncobj_syncobj=fake, pysyncobj_dns_resolver=None))
    assert version == internals.PINNED_VERSION
    assert missing == ["pysyncobj.syncobj._RAFT_STATE", "module pysyncobj.dns_resolver"]


def test_another_version_fails_even_with_every_name() -> None:
    text = failure(importer(pysyncobj_version=types.SimpleNamespace(VERSION="0.3.18")))
    assert "but pysyncobj 0.3.18 is installed; run: pip install pysyncobj==0.3.17" in text
    assert "missing" not in text
    text = failure(importer(pysyncobj_version=None))
    assert "no pysyncobj with a version is installed; missing: module pysyncobj.version" in text


def test_importing_the_raft_package_runs_the_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fresh import of lighthouse_cluster.raft (any of its modules) fails with the check's
    message; the modules already imported are put back afterwards."""
    for name in [m for m in sys.modules if m == "lighthouse_cluster.raft" or m.startswith("lighthouse_cluster.raft.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(importlib.import_module("pysyncobj.version"), "VERSION", "0.3.18")
    with pytest.raises(ImportError, match=r"needs pysyncobj==0\.3\.17 .* but pysyncobj 0\.3\.18 is installed"):
        importlib.import_module("lighthouse_cluster.raft.replication")


# -- the rule, on the source -------------------------------------------------------------------------


def python_files(*roots: Path) -> list[Path]:
    return [p for root in roots for p in sorted(root.rglob("*.py")) if "__pycache__" not in p.parts]


def pysyncobj_imports(path: Path) -> list[tuple[str, str]]:
    """(module, name) of every import of pysyncobj in ``path`` (name "" for ``import x``)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, "") for a in node.names if a.name.split(".")[0] == "pysyncobj"]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "pysyncobj" and not node.level:
            out += [(node.module or "", a.name) for a in node.names]
    return out


PUBLIC = {n for n in vars(pysyncobj) if not n.startswith("_") and not inspect.ismodule(getattr(pysyncobj, n))}


def test_only_the_raft_package_imports_pysyncobj() -> None:
    roots = [REPO / "lighthouse_cluster", REPO / "jepsen_like", REPO / "ftclient"]
    offenders = [f"{p.relative_to(REPO)}: {m}" for p in python_files(*roots) if RAFT not in p.parents
                 for m, _ in pysyncobj_imports(p)]
    assert offenders == []


def test_only_pysyncobj_internals_reaches_past_pysyncobjs_public_api() -> None:
    checked = {(e.module, e.name) for e in internals.INTERNALS if e.kind == internals.MODULE}
    for path in python_files(RAFT):
        for module, name in pysyncobj_imports(path):
            if module == "pysyncobj" and name in PUBLIC:
                continue
            where = f"{path.name}: from {module} import {name}"
            assert path.name == "pysyncobj_internals.py", f"{where}: private pysyncobj name outside pysyncobj_internals"
            # ``from pysyncobj import pickle`` is the module pysyncobj.pickle, checked by its names.
            assert (module, name) in checked or f"{module}.{name}" in {m for m, _ in checked}, \
                f"{where}: not in INTERNALS"


def _pysyncobj_private_names() -> set[str]:
    """Every private name of pysyncobj's classes: their attributes and the names their code uses."""
    names: set[str] = set()
    for modname in ("syncobj", "transport", "tcp_connection", "tcp_server", "node", "journal", "serializer",
                    "poller", "dns_resolver", "config"):
        module = importlib.import_module(f"pysyncobj.{modname}")
        for cls in (v for v in vars(module).values() if inspect.isclass(v) and v.__module__ == module.__name__):
            names.update(vars(cls))
            codes = [getattr(v, "__code__", None) for v in vars(cls).values()]
            codes += [getattr(getattr(v, "fget", None), "__code__", None) for v in vars(cls).values()]
            stack = [c for c in codes if c is not None]
            while stack:
                code = stack.pop()
                names.update(code.co_names)
                stack += [c for c in code.co_consts if inspect.iscode(c)]
    return {n for n in names if n.startswith("_") and not (n.startswith("__") and n.endswith("__"))}


def _names_used(path: Path) -> set[str]:
    """Attribute names ``path`` reads, writes or defines, and identifier-like strings it holds."""
    used: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute):
            used.add(node.attr)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            used.add(node.name)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
            used.add(node.value)
    return used


def test_every_private_pysyncobj_name_the_raft_package_uses_is_checked() -> None:
    checked = {e.name for e in internals.INTERNALS}
    private = _pysyncobj_private_names()
    assert {"_SyncObj__raftState", "_onTick", "_connections", "_TcpConnection__lastReadTime"} <= private
    mangled = re.compile(r"^_[A-Za-z]\w*__\w+$")
    for path in python_files(RAFT):
        used = _names_used(path)
        unchecked = sorted((used & private) - checked)
        assert unchecked == [], f"{path.name} uses private pysyncobj names the check does not cover: {unchecked}"
        if path.name != "pysyncobj_internals.py":
            assert not sorted(n for n in used if mangled.match(n)), f"{path.name} names a mangled attribute"


def test_every_raft_module_says_what_it_owns() -> None:
    for path in python_files(RAFT):
        assert ast.get_docstring(ast.parse(path.read_text())), f"{path.name} has no docstring"


def test_syncobj_internals_expose_only_checked_names() -> None:
    """The ``pso_*`` properties are built from INTERNALS entries; one that is not is refused."""
    bogus = internals.Internal("pysyncobj.syncobj", "_SyncObj__nothing", internals.INSTANCE, "SyncObj")
    with pytest.raises(TypeError, match="not a checked SyncObj attribute"):
        internals._attr(bogus, "")
    with pytest.raises(TypeError, match="not a checked SyncObj method"):
        internals._method(internals.RAFT_STATE_ATTR)
