"""Which rpt a result came from: the git commit of the source tree rpt runs from (an editable install, a clone),
or None where rpt's files are not tracked by git. Read once a process; results that compare runs (a scaling
law's points) name it."""

from __future__ import annotations

import functools
import subprocess
from pathlib import Path


@functools.lru_cache(maxsize=1)
def rpt_commit() -> str | None:
    """The short commit of rpt's checkout, with "+" where its tracked files differ from it; None outside git."""
    here = Path(__file__).resolve().parent
    try:  # (a wheel installed in a virtualenv inside some other git project is not that project's commit)
        tracked = subprocess.run(["git", "ls-files", "--error-unmatch", Path(__file__).name], capture_output=True,
                                 cwd=here, timeout=10)
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=here,
                                timeout=10)
        if tracked.returncode or commit.returncode:
            return None
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "."], cwd=here.parent, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return commit.stdout.strip() + ("+" if dirty.returncode else "")
