"""``python -m torch_bn_grad.bench [...]``: runs ``benchmarks/ops.py`` of the source tree.

The benchmarks live beside ``tests/`` in the repository, not in the installed
package; this entry finds them next to the package, so it works in a checkout
and with an editable install (``pip install --no-build-isolation -e .``), and
says so when the package was installed without its source tree.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType
from typing import Optional

SOURCE_ROOT = Path(__file__).resolve().parents[1]  # the checkout, for an editable install


def load(name: str = "ops") -> ModuleType:
    """The module ``benchmarks/<name>.py`` of the source tree this package was imported from."""
    path = SOURCE_ROOT / "benchmarks" / f"{name}.py"
    if not path.is_file():
        raise RuntimeError(
            f"python -m torch_bn_grad.bench runs the benchmarks of torch_bn_grad's source tree, but "
            f"{Path(__file__).parent} was installed without it (no {path}); install from a checkout with "
            f"`pip install --no-build-isolation -e .`, or run `python benchmarks/ops.py` in one")
    if str(SOURCE_ROOT) not in sys.path:
        sys.path.insert(0, str(SOURCE_ROOT))
    module = importlib.import_module(f"benchmarks.{name}")
    if Path(module.__file__).resolve() != path.resolve():
        raise RuntimeError(f"`benchmarks.{name}` resolves to {module.__file__}, not {path}: "
                           "another package named `benchmarks` shadows the source tree's")
    return module


def main(argv: Optional[list[str]] = None) -> None:
    """Command-line entry point: ``benchmarks.ops.main(argv)``."""
    try:
        ops = load("ops")
    except RuntimeError as error:
        sys.exit(f"error: {error}")
    ops.main(argv)


if __name__ == "__main__":
    main(sys.argv[1:])
