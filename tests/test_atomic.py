"""The one atomic writer: modes 0644/0755 whatever the umask, no partial files, directories swapped whole."""

from __future__ import annotations

import os
import stat

import pytest

from pyterrier_prob.atomic import atomic_directory, atomic_write, make_dirs, save_figure


@pytest.fixture
def strict_umask():
    old = os.umask(0o077)
    yield
    os.umask(old)


def _mode(p) -> int:
    return stat.S_IMODE(os.stat(p).st_mode)


def test_files_and_folders_are_readable(tmp_path, strict_umask):
    out = tmp_path / "a" / "b"
    path = atomic_write(out / "t.csv", "x,y\n1,2\n")
    assert open(path).read() == "x,y\n1,2\n"
    assert _mode(path) == 0o644 and _mode(out) == 0o755 and _mode(tmp_path / "a") == 0o755
    atomic_write(out / "b.bin", b"\x00\x01")
    assert (out / "b.bin").read_bytes() == b"\x00\x01" and _mode(out / "b.bin") == 0o644
    assert make_dirs(tmp_path / "c") == tmp_path / "c" and _mode(tmp_path / "c") == 0o755


def test_figure_is_a_readable_png(tmp_path, strict_umask):
    from matplotlib.figure import Figure

    fig = Figure()
    fig.subplots().plot([0, 1], [1, 0])
    path = save_figure(fig, tmp_path / "f.png")
    assert open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n" and _mode(path) == 0o644


def test_failed_write_leaves_the_old_file(tmp_path):
    target = tmp_path / "r.md"
    atomic_write(target, "old")

    def boom(f):
        f.write(b"partial")
        raise RuntimeError("interrupted")

    with pytest.raises(RuntimeError, match="interrupted"):
        atomic_write(target, boom)
    assert target.read_text() == "old" and os.listdir(tmp_path) == ["r.md"]


def test_directory_is_swapped_whole(tmp_path, strict_umask):
    target = tmp_path / "idx"
    with atomic_directory(target) as tmp:
        (tmp / "a").write_text("1")
    assert (target / "a").read_text() == "1" and _mode(target) == 0o755 and _mode(target / "a") == 0o644
    with pytest.raises(FileExistsError):
        with atomic_directory(target):
            pass
    with pytest.raises(RuntimeError):
        with atomic_directory(target, overwrite=True) as tmp:
            (tmp / "b").write_text("2")
            raise RuntimeError("interrupted")
    assert sorted(os.listdir(target)) == ["a"] and os.listdir(tmp_path) == ["idx"]
    with atomic_directory(target, overwrite=True) as tmp:
        (tmp / "b").write_text("2")
    assert sorted(os.listdir(target)) == ["b"] and os.listdir(tmp_path) == ["idx"]
