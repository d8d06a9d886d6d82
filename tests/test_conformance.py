"""Every registered backend through the conformance kit -- the same kit a plugin author runs.

Classes come from the registry (built-ins, and plugins installed in the environment); one that cannot
run on this machine is skipped with its own ``check`` reasons. Quick cases: seconds per backend.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from moe.registry import experts_classes, prepare_finalize_classes
from moe.testing import check_experts, check_prepare_finalize

EXPERTS = experts_classes()
PREPARE_FINALIZE = prepare_finalize_classes()


def _conclude(report) -> None:
    if report.ran_nothing and not report.failures:
        pytest.skip("cannot run here: " + "; ".join(report.skip_reasons()))
    report.assert_ok()


def test_the_registry_is_not_empty():
    assert {"reference", "torch_grouped"} <= set(EXPERTS)
    assert {"local", "batched"} <= set(PREPARE_FINALIZE)


@pytest.mark.parametrize("name", list(EXPERTS))
def test_experts_conform(name):
    _conclude(check_experts(EXPERTS[name]))


@pytest.mark.parametrize("name", list(PREPARE_FINALIZE))
def test_prepare_finalize_conforms(name):
    _conclude(check_prepare_finalize(PREPARE_FINALIZE[name]))


PLUGIN = Path(__file__).resolve().parents[1] / "examples" / "plugin_backend"
PLUGIN_TEST = '''
from moe.testing.pytest_plugin import experts_conformance
from moe_plugin_example.experts import EinsumExperts

test_plugin_einsum = experts_conformance(EinsumExperts)  # the one line a plugin author adds


def test_whole_report(moe_conformance):  # the plugin's fixture (pytest11 entry point, or -p as here)
    print(moe_conformance(EinsumExperts))
'''


def test_example_plugin_passes_the_kit_as_its_author_runs_it(tmp_path):
    """The example plugin, checked from its own test file in a fresh pytest (installed or not)."""
    (tmp_path / "test_plugin_einsum.py").write_text(PLUGIN_TEST)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(PLUGIN), os.environ.get("PYTHONPATH")])))
    # "-p no:moe" keeps an installed pytest11 entry point from registering the plugin a second time
    command = [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "-p", "no:moe",
               "-p", "moe.testing.pytest_plugin", "--moe-conformance=quick", "test_plugin_einsum.py"]
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert re.search(r"experts plugin_einsum on .+ \(quick\): PASSED", done.stdout), done.stdout
    last = done.stdout.strip().splitlines()[-1]
    assert " passed" in last and "failed" not in last and "skipped" not in last, done.stdout
