"""What the package holds once: one root for every error it raises on purpose
(``tpu_helpers.errors``), one table of model families (``tpu_helpers.families``)."""

import importlib
import inspect
import pkgutil

import pytest

import tpu_helpers
from tpu_helpers.errors import TpuHelpersError


def test_every_error_class_of_the_package_derives_from_the_root():
    found = {}
    for info in pkgutil.walk_packages(tpu_helpers.__path__, "tpu_helpers."):
        module = importlib.import_module(info.name)
        for name, value in vars(module).items():
            is_error = inspect.isclass(value) and issubclass(value, BaseException)
            if is_error and value.__module__.startswith("tpu_helpers"):
                found[f"{value.__module__}.{name}"] = value
    assert len(found) >= 8, sorted(found)  # the classes of the errors module's table
    strays = [name for name, cls in found.items() if not issubclass(cls, TpuHelpersError)]
    assert strays == []


#: Raises that name no class of their own, each read here: a helper in the same function that
#: returns a ``RecordsError`` (``bad``), a ``Batches`` method that returns the package's
#: error for data that ran out (``ran_out``), and TensorFlow's own error re-raised with the
#: shard named (``type(err)``: a caller catching ``tf.errors.DataLossError`` still does).
RAISES_READ_HERE = {
    ("tpu_helpers.records.source", "bad"),
    ("*", "ran_out"),
    ("tpu_helpers.engine", "type"),
}


def _raised_names(tree):
    """``(name, line)`` of each ``raise Name(...)`` or ``raise obj.name(...)``."""
    import ast

    for node in ast.walk(tree):
        if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
            func = node.exc.func
            if isinstance(func, ast.Name):
                yield func.id, node.lineno
            elif isinstance(func, ast.Attribute):
                yield func.attr, node.lineno


def _imported_inside(tree, name):
    """``name`` as a function of the module imports it (``from tpu_helpers.x import name``)."""
    import ast

    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and name in {a.name for a in node.names}:
            return getattr(importlib.import_module(node.module), name, None)
    return None


def test_every_raise_in_the_package_raises_a_subclass_of_the_root():
    """``except TpuHelpersError`` catches every error the package raises on purpose; each
    also keeps the built-in base a caller would catch (``ValueError``, ``TypeError`` ...)."""
    import ast

    strays, checked = [], 0
    for info in pkgutil.walk_packages(tpu_helpers.__path__, "tpu_helpers."):
        module = importlib.import_module(info.name)
        tree = ast.parse(inspect.getsource(module))
        for name, line in _raised_names(tree):
            if (info.name, name) in RAISES_READ_HERE or ("*", name) in RAISES_READ_HERE:
                continue
            raised = getattr(module, name, None) or _imported_inside(tree, name)
            checked += 1
            if not (inspect.isclass(raised) and issubclass(raised, TpuHelpersError)):
                strays.append(f"{info.name}:{line} raise {name}(...)")
    assert checked > 150 and strays == [], strays


def test_the_family_facts_come_from_one_table():
    from tpu_helpers import families, packing, runtime, text

    assert runtime.KERAS3_FAMILIES is families.KERAS3
    assert text.OFFSET_POSITIONS is families.OFFSET_POSITIONS
    assert packing.FAMILIES is families.PACKED
    assert all(packing.FAMILY[n] is families.FAMILIES[n].packed for n in packing.FAMILIES)
    assert {"roberta", "xlm-roberta", "camembert", "mpnet"} <= families.OFFSET_POSITIONS
    assert not {"bert", "distilbert", "albert", "electra"} & families.OFFSET_POSITIONS
    for name in families.KERAS3:  # each head the Keras 3 engine builds names its class
        assert families.FAMILIES[name].keras3.architecture.endswith("Classification")


def test_each_heads_model_prefix_is_the_one_transformers_names_its_encoder_by():
    transformers = pytest.importorskip("transformers")
    from tpu_helpers import families

    if not hasattr(transformers, "TFBertModel"):
        pytest.skip("this transformers has no TF classes (they say the prefix without torch)")
    for name in families.KERAS3:
        head = families.FAMILIES[name].keras3
        assert getattr(transformers, f"TF{head.architecture}").base_model_prefix == head.prefix


def test_one_training_loop_and_one_prediction_serve_both_engines():
    from pathlib import Path

    from tpu_helpers import checkpoints, engine, keras3, metrics

    package = Path(tpu_helpers.__file__).parent
    for name in ("fit_resumable", "predict_classes"):
        defined = [
            str(path.relative_to(package))
            for path in sorted(package.rglob("*.py"))
            if f"\ndef {name}(" in path.read_text()
        ]
        assert defined == ["engine.py"], (name, defined)
    assert checkpoints.fit_resumable is keras3.fit_resumable is engine.fit_resumable
    assert metrics.predict_classes is keras3.predict_classes is engine.predict_classes


def _import_graph() -> dict[str, set[str]]:
    """Every import among the package's modules, those inside functions included."""
    import ast
    from pathlib import Path

    root = Path(tpu_helpers.__file__).parent
    modules = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    kept = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(kept + ([node.module] if node.module else []))
                targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
            else:
                continue
            graph[name] |= {t for t in targets if t in modules and t != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The groups of modules that import each other, directly or around a circle."""
    reach = {name: set() for name in graph}
    for name in graph:
        todo = list(graph[name])
        while todo:
            other = todo.pop()
            if other not in reach[name]:
                reach[name].add(other)
                todo.extend(graph[other])
    groups = {
        frozenset({n} | {m for m in reach[n] if n in reach[m]}) for n in graph if n in reach[n]
    }
    return sorted((set(g) for g in groups), key=sorted)


#: The one circle left (both engines and the core re-export each other's entry points:
#: ``keras3.fit_resumable`` is ``engine.fit_resumable``, which picks the engine's trainer).
KNOWN_CYCLE = {
    f"tpu_helpers.{m}" for m in ("checkpoints", "engine", "keras3", "metrics", "observe")
}


def test_no_module_imports_itself_around_a_circle_but_the_known_one():
    """A new import circle fails here, and so does one that grows; the known one is named
    so that it can only shrink."""
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [{"a", "b"}]  # the finder finds
    cycles = _cycles(_import_graph())
    assert all(cycle <= KNOWN_CYCLE for cycle in cycles), cycles
