"""A scratch folder every user may traverse, for tests that run processes as another uid."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def traversable_folder(prefix: str) -> Iterator[Path]:
    """A new folder (``prefix`` begins its name) every user may traverse, mode 0755: pytest's
    own are root's, 0700. Removed with all it holds on leaving."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        path.chmod(0o755)
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
