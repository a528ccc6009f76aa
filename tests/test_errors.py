"""One root for every error the package raises on purpose (``tpu_helpers.errors``)."""

import importlib
import inspect
import pkgutil

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
