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


def test_sections_keep_their_own_names_side_by_side():
    from moe.workspace import WorkspaceLayout

    first, second = WorkspaceShapes.of(out=((3,), torch.float32)), WorkspaceShapes.of(out=((5,), torch.int32), x=((2,), torch.uint8))
    layout = WorkspaceLayout.of(prepare_finalize=first, experts=second)
    assert layout.nbytes == first.nbytes + second.nbytes == 3 * ALIGNMENT
    views = WorkspaceManager().take_sections(layout, caller="t")
    assert list(views) == ["prepare_finalize", "experts"] and list(views["experts"]) == ["out", "x"]
    assert views["prepare_finalize"]["out"].dtype == torch.float32 and views["experts"]["out"].shape == (5,)
    base = views["prepare_finalize"]["out"].data_ptr()
    assert [views["experts"][n].data_ptr() - base for n in ("out", "x")] == [ALIGNMENT, 2 * ALIGNMENT]


def test_generation_counts_the_buffers_reserve_replaced():
    manager = WorkspaceManager()
    assert manager.generation == 0
    manager.reserve(1024)
    manager.reserve(512)  # fits: same buffer
    manager.take(WorkspaceShapes.of(x=((16,), torch.float32)))
    assert manager.generation == 1
    manager.take(WorkspaceShapes.of(x=((1024,), torch.float32)))  # grows
    assert manager.generation == 2
