"""The guard that fails a session which wrote into the repository (tests/support/repoguard.py)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from support import repoguard


@pytest.fixture
def repository(tmp_path: Path) -> Path:
    """A fresh git checkout with one committed file and a .gitignore."""

    def git(*args: str) -> None:
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True, timeout=30)

    git("init", "-q")
    (tmp_path / ".gitignore").write_text("__pycache__/\n")
    (tmp_path / "tracked.py").write_text("x = 1\n")
    (tmp_path / "dirty.py").write_text("y = 1\n")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@example.invalid", "commit", "-q", "-m", "init")
    (tmp_path / "dirty.py").write_text("y = 2\n")  # already modified before the "session"
    return tmp_path


def test_repository_root_is_found_from_a_subfolder(repository: Path) -> None:
    (repository / "sub").mkdir()
    assert repoguard.repository_root(repository / "sub") == repository.resolve()


def test_files_created_or_modified_are_reported_and_ignored_ones_are_not(
    repository: Path,
) -> None:
    before = repoguard.snapshot(repository)
    assert repoguard.changes(before, repoguard.snapshot(repository)) == []
    (repository / "10.213.0.3:").mkdir()
    (repository / "10.213.0.3:" / "step-1.ckpt").write_bytes(b"blob")
    (repository / "tracked.py").write_text("x = 2\n")
    (repository / "__pycache__").mkdir()
    (repository / "__pycache__" / "tracked.cpython-311.pyc").write_bytes(b"")
    assert repoguard.changes(before, repoguard.snapshot(repository)) == [
        "10.213.0.3:/step-1.ckpt",
        "tracked.py",
    ]


def test_a_file_dirty_before_counts_only_when_touched_again(repository: Path) -> None:
    before = repoguard.snapshot(repository)
    assert "dirty.py" in before
    assert repoguard.changes(before, repoguard.snapshot(repository)) == []
    stat = (repository / "dirty.py").stat()
    os.utime(repository / "dirty.py", ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert repoguard.changes(before, repoguard.snapshot(repository)) == ["dirty.py"]


def test_outside_a_checkout_there_is_no_root(tmp_path: Path) -> None:
    assert repoguard.repository_root(tmp_path) is None
