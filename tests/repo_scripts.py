"""The repository's scripts imported as modules, for the tests of the benchmark and data tools."""
from __future__ import annotations

import importlib.util
import sys
from types import ModuleType

from harness import REPO_ROOT


def load_script(relative: str) -> ModuleType:
    """Imports a repository script as a module (benchmarks/ is not a package)."""
    path = REPO_ROOT / relative
    spec = importlib.util.spec_from_file_location(path.stem + "_under_test", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module
