"""The kernel's mount table and file identity (primitives/files/mounts.py)."""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath

from slimkit.primitives.files import mounts
from slimkit.primitives.files.guard import overlap_reason, protected_reason
from tests.mounting import bind_mount

TABLE = """\
22 27 0:21 / /proc rw,relatime - proc proc rw
42 27 254:0 /data/my\\040models /mnt/models rw,relatime - ext4 /dev/vda rw
43 27 254:0 / / rw,relatime - ext4 /dev/vda rw
44 27 254:0 /data /srv/data rw,relatime - ext4 /dev/vda rw
bad line
"""


def test_the_mount_table_is_parsed_with_the_kernels_escapes():
    table = mounts.parse_mountinfo(TABLE)
    assert [m.point for m in table] == [PurePosixPath(p) for p in ("/proc", "/mnt/models", "/", "/srv/data")]
    assert table[1] == mounts.Mount("254:0", PurePosixPath("/data/my models"), PurePosixPath("/mnt/models"))


def test_aliases_of_a_path_under_every_bind_mount_of_its_device():
    table = mounts.parse_mountinfo(TABLE)
    # /srv/data/my models/llama is /data/my models/llama of the device, also shown at /mnt/models/llama
    found = mounts.aliases("/srv/data/my models/llama", table)
    assert found == [Path("/srv/data/my models/llama"), Path("/mnt/models/llama"), Path("/data/my models/llama")]
    assert mounts.aliases("/proc/self/x", table)[0] == Path("/proc/self/x").resolve()


def test_a_same_filesystem_bind_mount_is_a_mount_point_and_the_same_file(tmp_path):
    source = tmp_path / "data"
    (source / "model").mkdir(parents=True)
    with bind_mount(source, tmp_path / "alias") as alias:
        assert not os.path.ismount(alias)  # the same device and a different inode: only the table knows
        assert mounts.is_mount_point(alias)
        assert not mounts.is_mount_point(source)
        assert mounts.identity(alias / "model") == mounts.identity(source / "model")
        assert alias / "model" in mounts.aliases(source / "model")
        assert mounts.mounts_inside(tmp_path) == [PurePosixPath(alias)]
        # an output named through the alias is the input, inside it, or a folder holding it
        assert overlap_reason(alias / "model", [source / "model"]) == f"the input {source / 'model'} itself"
        assert overlap_reason(alias / "model" / "out", [source / "model"]).startswith("inside the input")
        assert overlap_reason(source, [alias / "model"]).startswith("a folder holding the input")
        assert overlap_reason(tmp_path / "elsewhere", [alias / "model"]) is None


def test_a_protected_folder_is_recognised_under_an_alias(tmp_path, monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    with bind_mount(tmp_path, tmp_path.parent / f"{tmp_path.name}-alias") as alias:
        assert protected_reason(alias / "work") == "the current working directory"
        assert protected_reason(alias) == "a parent of the current working directory"


def test_nearest_existing_is_the_folder_an_unwritten_output_is_under(tmp_path):
    assert mounts.nearest_existing(tmp_path / "a" / "b") == tmp_path.resolve()
