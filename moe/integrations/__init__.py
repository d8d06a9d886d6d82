"""Integrations of `moe` into model libraries, each an optional import of its own:

- ``moe.integrations.transformers``: Hugging Face transformers (>= 5) models run their MoE experts on
  `moe.FusedMoE` (``experts_implementation="moe"``, or ``use_moe(model)``); needs ``moe[transformers]``.

``moe.integrations._binding`` holds what does not depend on the library: one experts module bound to one
`FusedMoE`, prepared once and again when the module's parameters change.
"""
