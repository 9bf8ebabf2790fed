"""Build a directory beside its destination and swap it in only when it is complete."""
from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def building_dir(out_dir: Path) -> Iterator[Path]:
    """Yield an empty temp dir beside `out_dir`; on a clean exit it replaces `out_dir`.

    On any exception the temp dir is removed and `out_dir` is left as it was. A previous
    `out_dir` is renamed aside first and deleted after the new one is in place, so a reader sees
    either the old complete directory or the new complete one (never a half-written one).
    """
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; a model directory is an ordinary one
    try:
        yield tmp
        if out_dir.exists():
            old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
            os.replace(out_dir, old)
            os.replace(tmp, out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
