"""The commit a result came from (rpt/runtime/version.py): this checkout's, and none for a copy of rpt that git
does not track (a wheel in a virtualenv inside another project's repository)."""

import pytest

from rpt.runtime.version import rpt_commit


def test_the_commit_a_result_came_from_is_this_checkout_s():
    import subprocess
    from pathlib import Path

    import rpt

    root = Path(rpt.__file__).resolve().parent
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True)
    if head.returncode:
        pytest.skip("rpt does not run from a git checkout here")
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", "."], cwd=root,
                           capture_output=True, text=True).stdout.strip()
    assert rpt_commit() == head.stdout.strip() + ("+" if dirty else "")


def test_a_copy_of_rpt_untracked_inside_another_git_project_names_no_commit(tmp_path):
    import importlib.util
    import shutil
    import subprocess

    from rpt.runtime import version

    if subprocess.run(["git", "--version"], capture_output=True).returncode:
        pytest.skip("no git here")
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    subprocess.run(["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q",
                    "--allow-empty", "-m", "theirs"], check=True)
    site = tmp_path / ".venv" / "site-packages"  # rpt as a wheel installs it: in the project's tree, untracked
    site.mkdir(parents=True)
    shutil.copy(version.__file__, site / "version.py")
    spec = importlib.util.spec_from_file_location("copied_version", site / "version.py")
    copied = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(copied)
    assert copied.rpt_commit() is None
