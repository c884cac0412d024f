"""The architecture holds: imports point one way, rooms keep their doors.

Walks kvjax/ (and the entry points and notebooks) with ``ast`` and fails on an upward or sideways
import between layers, a private name used across modules, a kvjax import inside a function, or a
``sys.path`` edit in an entry point. The layers, lowest first (``kvjax/__init__.py``'s docstring):
the core (checks, select, scores, budgets, policies, and the modules of those packages), the
leaves (rundir, plotting, distributed), then ``kvjax.lab`` and ``kvjax.model`` (which never
import each other), then ``kvjax.eval``.
"""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
CORE = {"kvjax.checks", "kvjax.select", "kvjax.scores", "kvjax.budgets", "kvjax.policies"}
CORE_PACKAGES = ("kvjax.select.", "kvjax.scores.", "kvjax.budgets.", "kvjax.policies.")
LEAVES = {"kvjax.rundir", "kvjax.plotting", "kvjax.distributed"}


def _module(path: pathlib.Path) -> str:
  parts = list(path.relative_to(ROOT).with_suffix("").parts)
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module(p): p for p in sorted((ROOT / "kvjax").rglob("*.py"))}
ENTRY_POINTS = sorted((ROOT / "experiments").glob("*.py")) + sorted(
  (ROOT / "notebooks").glob("*.py")
)


def layer(module: str) -> tuple[int, str]:
  """``(rank, room)``: a module may import lower ranks, and its own room."""
  if module == "kvjax":
    return 1, "kvjax"  # the package re-exports the core only
  if module in CORE or module.startswith(CORE_PACKAGES):
    return 0, "core"
  if module in LEAVES:
    return 1, module
  room = module.split(".")[1]
  return {"lab": 2, "model": 2, "eval": 3}[room], room


def _resolve(name: str) -> str | None:
  while name and name not in MODULES:
    name = name.rpartition(".")[0]
  return name or None


def _absolute(node: ast.ImportFrom, me: str | None) -> str | None:
  """The module ``node`` imports from, a relative import (``from .x import y``, ``from .. import
  checks``) resolved against the importing module ``me``."""
  if not node.level:
    return node.module
  if me is None:
    return None
  package = me if MODULES[me].name == "__init__.py" else me.rpartition(".")[0]
  for _ in range(node.level - 1):
    package = package.rpartition(".")[0]
  return f"{package}.{node.module}" if node.module else package


def _imports(tree: ast.Module, me: str | None = None):
  """``(node, imported kvjax module, aliases)`` for every kvjax import in ``tree``, the module
  ``me`` (relative imports are resolved against it)."""
  for node in ast.walk(tree):
    module = _absolute(node, me) if isinstance(node, ast.ImportFrom) else None
    if module and module.startswith("kvjax"):
      for a in node.names:
        full = f"{module}.{a.name}"
        target = full if full in MODULES else _resolve(module)
        yield node, target, a
    elif isinstance(node, ast.Import):
      for a in node.names:
        if a.name.startswith("kvjax"):
          yield node, _resolve(a.name), a


def _function_level(tree: ast.Module) -> set[int]:
  ids = set()
  for fn in ast.walk(tree):
    if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
      ids |= {id(n) for n in ast.walk(fn) if isinstance(n, ast.Import | ast.ImportFrom)}
  return ids


def _aliases(tree: ast.Module, me: str | None = None) -> dict[str, str]:
  out = {}
  for _, target, a in _imports(tree, me):
    if target is not None:
      out[a.asname or a.name.split(".")[-1]] = target
  return out


def test_imports_point_one_way_with_no_local_imports():
  problems = []
  for me, path in MODULES.items():
    tree = ast.parse(path.read_text())
    local = _function_level(tree)
    rank, room = layer(me)
    for node, target, _ in _imports(tree, me):
      where = f"{path.relative_to(ROOT)}:{node.lineno}"
      if id(node) in local:
        problems.append(f"{where}: kvjax import inside a function")
      if target is None or target == me:
        continue
      t_rank, t_room = layer(target)
      if not (t_rank < rank or t_room == room):
        problems.append(f"{where}: {me} (layer {rank}) imports {target} (layer {t_rank})")
  assert not problems, "\n".join(problems)


def test_no_private_names_across_modules():
  problems = []
  for path in [*MODULES.values(), *ENTRY_POINTS]:
    tree = ast.parse(path.read_text())
    me = _module(path) if path.is_relative_to(ROOT / "kvjax") else None
    aliases = _aliases(tree, me)
    for node, target, a in _imports(tree, me):
      if a.name.startswith("_") and target != me:
        problems.append(f"{path.relative_to(ROOT)}:{node.lineno}: imports {a.name}")
    for node in ast.walk(tree):
      if (
        isinstance(node, ast.Attribute)
        and node.attr.startswith("_")
        and not node.attr.startswith("__")
        and isinstance(node.value, ast.Name)
        and aliases.get(node.value.id) not in (None, me)
      ):
        problems.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value.id}.{node.attr}")
  assert not problems, "\n".join(problems)


def test_entry_points_do_not_edit_sys_path():
  for path in ENTRY_POINTS:
    assert "sys.path" not in path.read_text(), path


def test_lab_and_model_are_independent_and_the_core_imports_only_the_core():
  tree_of = {m: ast.parse(p.read_text()) for m, p in MODULES.items()}
  for me, tree in tree_of.items():
    targets = {t for _, t, _ in _imports(tree, me) if t}
    if layer(me)[1] == "core":
      assert all(layer(t)[1] == "core" for t in targets), (me, targets)
    if me.startswith("kvjax.lab"):
      assert not any(t.startswith(("kvjax.model", "kvjax.eval")) for t in targets), me
    if me.startswith("kvjax.model"):
      assert not any(t.startswith(("kvjax.lab", "kvjax.eval")) for t in targets), me


def _name_literals(node: ast.AST, known: set[str]) -> list[str]:
  """Policy names written as string literals among a comparison's operands (``x == "h2o"``,
  ``x in ("tova", ...)``)."""
  found = []
  for operand in [node.left, *node.comparators]:
    items = operand.elts if isinstance(operand, ast.Tuple | ast.List | ast.Set) else [operand]
    for item in items:
      if isinstance(item, ast.Constant) and item.value in known:
        found.append(item.value)
  return found


def test_nothing_outside_the_policies_compares_a_policy_name():
  """Names live at the boundary (configs, ``policies.make``): the model, the lab, the evaluation
  and the entry points read a policy's properties, never compare its name."""
  from kvjax import policies  # noqa: PLC0415 (the registry, imported here to keep this file ast-only)

  known = set(policies.names())
  paths = [
    p for room in ("model", "eval", "lab") for p in sorted((ROOT / "kvjax" / room).rglob("*.py"))
  ] + sorted((ROOT / "experiments").glob("*.py"))
  problems = []
  for path in paths:
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.Compare):
        for name in _name_literals(node, known):
          problems.append(f"{path.relative_to(ROOT)}:{node.lineno}: compares {name!r}")
  assert not problems, "\n".join(problems)
