"""One rank's failure ends the whole job, and no file the user had is lost: locks, checkpoint saves on a
read-only or missing folder, fine-tuning's failing rank, ranks reading different data."""
import errno
import os
import types

import pytest

from minizero.files import FolderLock, FolderLocked


def test_lock_release_raises_nothing_when_its_file_cannot_be_removed(tmp_path, monkeypatch):
    """A read-only OUT at the end (remounted, a full quota): release() raised EROFS inside the main job's
    failure handler, a second traceback, and MPI_Abort was never called (the other ranks waited)."""
    lock = FolderLock(str(tmp_path))
    lock.acquire()

    def refuse(path):
        raise OSError(errno.EROFS, "Read-only file system", path)

    with monkeypatch.context() as m:
        m.setattr(os, "remove", refuse)
        lock.release()
    assert lock.fd is None
    FolderLock(str(tmp_path)).acquire()  # the file stayed behind, unlocked: taken again


def test_the_default_save_dir_inside_out_is_locked(tmp_path):
    """Two jobs: A with --out o (checkpoints in o/checkpoints), B with --out o2 --save-dir o/checkpoints. A locked
    only o, so B's lock on o/checkpoints succeeded and they pruned each other's checkpoints."""
    from minizero.train import _lock_output, _release

    out = tmp_path / "o"
    args = types.SimpleNamespace(no_save=False, out=str(out), save_dir=str(out / "checkpoints"), save_every=5)
    world = types.SimpleNamespace(bcast=lambda obj, root: obj)
    locks, refusal = _lock_output(args, types.SimpleNamespace(rank=0), world)
    try:
        assert refusal is None and len(locks) == 2
        with pytest.raises(FolderLocked, match="in use by another minizero job"):
            FolderLock(str(out / "checkpoints")).acquire()
    finally:
        _release(locks)
    args.save_dir = str(out)  # checkpoints in OUT itself: one lock
    locks, refusal = _lock_output(args, types.SimpleNamespace(rank=0), world)
    _release(locks)
    assert refusal is None and len(locks) == 1
