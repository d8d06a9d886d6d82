"""Every oracle decision of the presets on the simulated platforms, as one JSON document.

    python benchmarks/plan_snapshot.py > before.json     # on one commit
    python benchmarks/plan_snapshot.py > after.json      # on another
    diff before.json after.json                          # a refactor must leave it empty

Each entry is ``plan(problem, Platform.preset(p), Policy()).to_json()`` for one (preset, scheme, platform,
expert-parallel size), keyed by those four; problems a scheme cannot store (its scale block does not divide
H or I) are recorded with the error instead. The registered backends are the built-in ones (plugins
installed in the environment are left out), so the output depends on this tree only.
"""

from __future__ import annotations

import json
import sys

from moe.errors import MoEError
from moe.oracle import Policy, plan
from moe.platform import PRESET_NAMES, Platform
from moe.presets import load_preset, preset_names
from moe.problem import MoEProblem, ParallelConfig
from moe.registry import experts_classes, prepare_finalize_classes

SCHEMES = ("bf16", "fp8", "fp8_token", "fp8_block", "mxfp8", "mxfp4", "nvfp4")
BUCKETS = (1, 16, 256, 4096)


def builtin(classes: dict[str, type]) -> dict[str, type]:
    return {name: cls for name, cls in classes.items() if cls.__module__.startswith("moe.")}


def snapshot() -> dict[str, object]:
    experts, transports = builtin(experts_classes()), builtin(prepare_finalize_classes())
    policy = Policy(buckets=BUCKETS)
    result: dict[str, object] = {}
    for model in preset_names():
        preset = load_preset(model)
        for scheme in SCHEMES:
            for ep in (1, 2):
                try:
                    problem = MoEProblem.create(
                        num_experts=preset.num_experts, top_k=preset.top_k, hidden_size=preset.hidden_size,
                        intermediate_size=preset.intermediate_size, activation=preset.activation,
                        has_bias=preset.has_bias, quant=scheme, max_tokens=BUCKETS[-1],
                        parallel=ParallelConfig(ep_size=ep))
                except MoEError as error:
                    result[f"{model}/{scheme}/ep{ep}"] = {"error": str(error)}
                    continue
                for name in PRESET_NAMES:
                    decision = plan(problem, Platform.preset(name), policy, experts=experts,
                                    prepare_finalize=transports, allow_empty=True)
                    result[f"{model}/{scheme}/ep{ep}/{name}"] = decision.to_json()
    return result


if __name__ == "__main__":
    json.dump(snapshot(), sys.stdout, indent=1, sort_keys=True)
    sys.stdout.write("\n")
