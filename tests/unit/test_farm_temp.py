"""Issue 33 row 7: Ray makes its temp and session folders 0777 (no sticky bit), and
another local user replaced the raylet socket in them. `kiln farm up` now puts Ray's
folder inside a 0700 folder of this user's, and checks that folder (and every folder
above it) before Ray starts, and again for a farm already up."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from kiln.workers.serve.cluster import private_ray_temp, temp_dir_problem


def test_row7_rays_0777_folders_sit_inside_a_private_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    parent, ray_temp = private_ray_temp()
    sockets = Path(ray_temp) / "session_latest" / "sockets"
    sockets.mkdir(parents=True)
    for folder in (Path(ray_temp), sockets.parent, sockets):
        folder.chmod(0o777)  # what Ray does with its own folders
    assert Path(ray_temp).parent == Path(parent)
    assert (os.stat(parent).st_mode & 0o777) == 0o700
    assert temp_dir_problem(parent) is None
    os.chmod(parent, 0o755)  # readable by others: they can reach the sockets again
    assert "not drwx------" in (temp_dir_problem(parent) or "")


def test_row7_farm_up_refuses_a_temp_folder_others_can_write_above(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shared = tmp_path / "shared-tmp"
    shared.mkdir()
    shared.chmod(0o777)  # no sticky bit: others may rename our folder away
    monkeypatch.setattr(tempfile, "tempdir", str(shared))
    with pytest.raises(RuntimeError, match="writable by"):
        private_ray_temp()
    assert not list(shared.iterdir())  # nothing left behind
