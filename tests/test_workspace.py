import pytest
import torch

from moe import MoEConfigError, WorkspaceError, WorkspaceManager, WorkspaceShapes
from moe.workspace import ALIGNMENT


def test_views_are_aligned_shaped_and_disjoint():
    shapes = WorkspaceShapes.of(a=((3, 5), torch.float16), b=((7,), torch.float32), c=((2, 2, 2), torch.int32))
    manager = WorkspaceManager()
    views = manager.take(shapes, caller="t")
    assert [tuple(views[n].shape) for n in "abc"] == [(3, 5), (7,), (2, 2, 2)]
    assert [views[n].dtype for n in "abc"] == [torch.float16, torch.float32, torch.int32]
    base = views["a"].data_ptr()
    offsets = [views[n].data_ptr() - base for n in "abc"]
    assert offsets == [0, ALIGNMENT, 2 * ALIGNMENT]
    assert shapes.nbytes == 3 * ALIGNMENT == manager.reserved_bytes
    views["a"].fill_(1), views["b"].fill_(2), views["c"].fill_(3)
    assert views["a"].eq(1).all() and views["b"].eq(2).all() and views["c"].eq(3).all()


def test_unlocked_manager_grows_and_locked_one_refuses():
    manager = WorkspaceManager()
    small, big = WorkspaceShapes.of(x=((10,), torch.float32)), WorkspaceShapes.of(x=((1000,), torch.float32))
    manager.take(small)
    manager.take(big)
    assert manager.reserved_bytes == big.nbytes
    manager.lock()
    manager.take(small)  # fits
    with pytest.raises(WorkspaceError, match=r"layer-3 needs 8192 bytes .* holds 4096 bytes"):
        manager.take(WorkspaceShapes.of(x=((2048,), torch.float32)), caller="layer-3")
    with pytest.raises(WorkspaceError, match="locked"):
        manager.reserve(10**6)


def test_missing_buffer_names_the_declared_ones():
    views = WorkspaceManager().take(WorkspaceShapes.of(out=((1,), torch.float32)))
    with pytest.raises(KeyError, match=r"no buffer 'scratch'; declared: \['out'\]"):
        views["scratch"]


def test_negative_dimension_rejected():
    with pytest.raises(MoEConfigError, match="negative dimension"):
        WorkspaceShapes.of(x=((-1, 2), torch.float32))


def test_zero_sized_buffers():
    views = WorkspaceManager().take(WorkspaceShapes.of(x=((0, 4), torch.bfloat16)))
    assert views["x"].shape == (0, 4)
