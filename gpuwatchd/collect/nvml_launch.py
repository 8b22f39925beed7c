"""Starts the NVML worker: ``python3 -I nvml_launch.py WORKER [FOLDER...]`` (docs/internals.md).

Runs the worker file as ``__main__`` through the import system's loader, which keeps its
compiled code in ``__pycache__``. Never imported.
"""

import sys
from importlib.util import module_from_spec, spec_from_file_location

del sys.path[0]  # this file's folder: none of its modules may shadow what the worker imports
worker, *folders = sys.argv[1:]
for folder in reversed(folders):
    if folder not in sys.path:
        sys.path.insert(0, folder)
del sys.argv[1:]
spec = spec_from_file_location("__main__", worker)
if spec is None or spec.loader is None:
    sys.exit(f"gpuwatchd: cannot load the NVML worker {worker!r}")
module = module_from_spec(spec)
sys.modules["__main__"] = module
spec.loader.exec_module(module)
