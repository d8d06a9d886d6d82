"""benchmarks/multicast_probe.py on a CPU: its Gluon kernel compiles for sm90 as a two-CTA cluster, the weight
block loaded once by TMA multicast for both CTAs where asked and by each CTA for itself otherwise; bad shapes and a
machine without a GPU get a clear answer."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import benchmark_script, compiled_in_subprocess

SCRIPT = "multicast_probe"


def test_the_kernel_compiles_for_a_two_cta_cluster_with_and_without_multicast():
    """Compiled for sm90 in a process of its own (Gluon does not run in the interpreter): a cluster kernel whose CTAs
    meet at cluster barriers; with ``MULTICAST`` the weight block's TMA load goes to the cluster (``.multicast::cluster``)
    beside each CTA's own load of its rows; without it both loads are each CTA's own."""
    pytest.importorskip("triton.experimental.gluon")
    if not benchmark_script(SCRIPT).multi_cta_gluon():
        pytest.skip("Gluon's TMA multicast needs Triton 3.9+")
    found = compiled_in_subprocess(
        SCRIPT, "[[(p := s.probe_ptx(mc)).count('.multicast::cluster'), p.count('cp.async.bulk.tensor.2d.shared::cta'),"
                " '.explicitcluster' in p, 'barrier.cluster.wait' in p, '%cluster_ctarank' in p]"
                " for mc in (True, False)]")
    multicast, each_own = found
    assert multicast == [1, 1, True, True, True]
    assert each_own[:2] == [0, 2] and each_own[2] and each_own[3]


def test_shapes_the_tiles_do_not_divide_are_refused_before_any_gpu_work():
    script = benchmark_script(SCRIPT)
    with pytest.raises(ValueError, match=r"M a positive multiple of 128.*got a \[100, 64\]"):
        script.run(torch.empty(100, 64), torch.empty(128, 64), True)
    with pytest.raises(ValueError, match=r"got a \[128, 64\], w \[128, 32\]"):
        script.run(torch.empty(128, 64), torch.empty(128, 32), False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_without_a_gpu_the_script_says_so(capsys):
    assert benchmark_script(SCRIPT).main(["--m", "256"]) == 2
    assert "needs an SM90+ CUDA GPU" in capsys.readouterr().err
