"""Triton Python-based backend ``quanta``, installed as ``<backend-dir>/quanta/model.py``.

Thin on purpose: the backend lives in ``quanta.frontends.triton.backend``. Triton's stub runs an
isolated interpreter that ignores ``PYTHONPATH``, so the launcher passes the serving
environment's import paths in ``QUANTA_PYTHONPATH`` and they are added here (as site dirs, so
``.pth`` files such as editable installs work) ahead of the interpreter's own site-packages.
The same file ships in the package as ``quanta/frontends/triton/backend_model.py``; a test keeps
the two identical.
"""

from __future__ import annotations

import os
import site
import sys


def _add_site_dirs() -> None:
    before = list(sys.path)
    for path in os.environ.get("QUANTA_PYTHONPATH", "").split(os.pathsep):
        if path and path not in before:
            site.addsitedir(path)
    added = [p for p in sys.path if p not in before]
    sys.path[:] = added + before


_add_site_dirs()

from quanta.frontends.triton.backend import TritonPythonModel  # noqa: E402

__all__ = ["TritonPythonModel"]
