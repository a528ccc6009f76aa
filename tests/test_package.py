"""What the package holds once: one root for every error it raises on purpose
(``tpu_helpers.core.errors``), one table of model families (``tpu_helpers.core.families``)."""

import importlib
import inspect
import pkgutil

import pytest

import tpu_helpers
from tpu_helpers.core.errors import TpuHelpersError


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
    ("tpu_helpers.data.records.source", "bad"),
    ("*", "ran_out"),
    ("tpu_helpers.core.engine", "type"),
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


def test_the_family_facts_come_from_one_table_and_no_module_offers_them_again():
    from tpu_helpers.core import families

    tables = [getattr(families, name) for name in families.__all__ if name.isupper()]
    offered = [
        f"{info.name}.{name}"
        for info in pkgutil.walk_packages(tpu_helpers.__path__, "tpu_helpers.")
        if info.name != "tpu_helpers.core.families" and not info.name.endswith("__main__")
        for module in [importlib.import_module(info.name)]
        for name in getattr(module, "__all__", ())
        if any(getattr(module, name, None) is table for table in tables)
    ]
    assert offered == [], offered
    assert {"roberta", "xlm-roberta", "camembert", "mpnet"} <= families.OFFSET_POSITIONS
    assert not {"bert", "distilbert", "albert", "electra"} & families.OFFSET_POSITIONS
    for name in families.KERAS3:  # each head the Keras 3 engine builds names its class
        assert families.FAMILIES[name].keras3.architecture.endswith("Classification")


def test_each_heads_model_prefix_is_the_one_transformers_names_its_encoder_by():
    transformers = pytest.importorskip("transformers")
    from tpu_helpers.core import families

    if not hasattr(transformers, "TFBertModel"):
        pytest.skip("this transformers has no TF classes (they say the prefix without torch)")
    for name in families.KERAS3:
        head = families.FAMILIES[name].keras3
        assert getattr(transformers, f"TF{head.architecture}").base_model_prefix == head.prefix


def test_one_training_loop_serves_both_engines_and_the_core_imports_neither():
    """Each engine's ``fit_resumable`` hands its trainer to ``engine.fit_with``, the one
    loop; the core names no engine (the graph below would show it as a circle too)."""
    from pathlib import Path

    from tpu_helpers.core import engine

    package = Path(tpu_helpers.__file__).parent
    loops = [  # the epochs are run where a trainer's epoch is called: in the core alone
        str(path.relative_to(package))
        for path in sorted(package.rglob("*.py"))
        if ".train_epoch(" in path.read_text()
    ]
    assert loops == ["core/engine.py"], loops
    for name in ("keras3", "tf_engine.trainer"):  # each engine's entry runs that loop
        module = importlib.import_module(f"tpu_helpers.{name}")
        assert "fit_with(" in inspect.getsource(module.fit_resumable), name
        assert "predict_with(" in inspect.getsource(module.predict_classes), name
    graph = _import_graph()
    assert not graph["tpu_helpers.core.engine"] & {
        "tpu_helpers.keras3",
        "tpu_helpers.tf_engine.trainer",
    }
    for name in ("keras3.trainer", "tf_engine.trainer"):
        assert {"tpu_helpers.core.engine"} <= graph[f"tpu_helpers.{name}"], name
    assert "check_same_run" in engine.__all__ and "InputBoundReport" not in dir(engine)


def test_the_keras3_package_binds_every_public_name_of_its_modules():
    """``keras3`` names its modules' ``__all__``: a name a module adds there and the package
    does not import would be declared and missing (notebooks call ``keras3.<name>``)."""
    from tpu_helpers import keras3

    missing = [name for name in keras3.__all__ if not hasattr(keras3, name)]
    assert missing == [] and len(keras3.__all__) == len(set(keras3.__all__)), missing
    modules = (keras3.distribution, keras3.models, keras3.packed, keras3.export, keras3.trainer)
    public = {name for module in modules for name in module.__all__}
    assert public <= set(keras3.__all__), public - set(keras3.__all__)  # the two lists agree


def test_the_tf_engine_refuses_a_keras3_model_naming_the_keras3_entry():
    from tpu_helpers.core.errors import EngineError
    from tpu_helpers.tf_engine import trainer

    keras3_model = type("Functional", (), {"__module__": "keras.src.models.functional"})()
    for call in (
        lambda: trainer.fit_resumable(keras3_model, None, 1, "unused"),
        lambda: trainer.predict_classes(keras3_model, None),
    ):
        with pytest.raises(EngineError, match=r"Functional is a Keras 3 model.*Fix: keras3\."):
            call()


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


#: The package's floors, top down (CONTRIBUTING.md draws them), by folder or module: a module
#: imports from its own floor or the floors above, and the two engines (floors 4 and 5) not
#: from each other.
FLOORS = {
    0: "core.errors core.checks core.validate core.families core.versions core.messages",
    1: "runtime",
    2: "core",
    3: "data",
    4: "keras3",
    5: "tf_engine",
    6: "llm",
    7: "teaching",
    8: "__main__",
}
KERAS3_ENGINE, TF_ENGINE = 4, 5


def _floor(module: str) -> int:
    """The floor of the longest entry of ``FLOORS`` that ``module`` is or is inside."""
    if module == "tpu_helpers":
        return max(FLOORS)
    name = module.removeprefix("tpu_helpers.")
    found = [
        (len(entry), floor)
        for floor, entries in FLOORS.items()
        for entry in entries.split()
        if name == entry or name.startswith(entry + ".")
    ]
    return max(found)[1]


def test_every_module_imports_only_from_its_floor_or_above_and_no_engine_from_the_other():
    wrong = []
    for module, imported in _import_graph().items():
        for other in imported - {"tpu_helpers"}:  # `from tpu_helpers import x` names x too
            here, there = _floor(module), _floor(other)
            if there > here or {here, there} == {KERAS3_ENGINE, TF_ENGINE}:
                wrong.append(f"{module} (floor {here}) imports {other} (floor {there})")
    assert wrong == [], wrong


def test_no_module_imports_itself_around_a_circle():
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [{"a", "b"}]  # the finder finds
    assert _cycles(_import_graph()) == []


#: Functions of more than 50 lines of code (docstrings not counted), with their length when
#: this list was made: none may grow, and a new one fails. Split one, and take it off.
LONG_FUNCTIONS: dict[str, int] = {}


def test_no_function_runs_over_50_lines_of_code_but_the_known_ones_which_only_shrink():
    import ast
    from pathlib import Path

    root = Path(tpu_helpers.__file__).parent
    found = {}
    for path in root.rglob("*.py"):
        module = ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                first = node.body[0]
                if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                    lines -= first.end_lineno - first.lineno + 1  # the docstring
                if lines > 50:
                    found[f"{module}.{node.name}"] = lines
    grown = {k: v for k, v in found.items() if v > LONG_FUNCTIONS.get(k, 50)}
    assert grown == {}, f"over 50 lines of code, or longer than listed: {grown}"


def test_the_package_speaks_through_one_logger_that_prints_and_can_be_quieted(capsys):
    import logging

    from tpu_helpers.core.messages import LOGGER, say

    say("[install] a line")
    assert capsys.readouterr().out == "[install] a line\n"  # the stdout of the moment
    level = LOGGER.level
    try:
        logging.getLogger("tpu_helpers").setLevel(logging.WARNING)
        say("not shown")
        assert capsys.readouterr().out == ""
    finally:
        LOGGER.setLevel(level)
    from pathlib import Path

    package = Path(tpu_helpers.__file__).parent
    printing = sorted(  # the name `print` in code (not in strings): a call, or passed as log=
        str(path.relative_to(package))
        for path in package.rglob("*.py")
        if _names_print(path.read_text())
    )
    # the command line's output and the run report's figures outside IPython are data
    assert printing == ["__main__.py", "teaching/report.py"], printing


def _names_print(source: str) -> bool:
    """Whether ``source`` names Python's ``print`` in its code (``tf.print`` is another)."""
    import io
    import tokenize

    tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    return any(
        token.type == tokenize.NAME and token.string == "print" and before.string != "."
        for before, token in zip(tokens, tokens[1:], strict=False)
    )
