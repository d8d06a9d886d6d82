"""FlashInfer's autotuner results kept in the tuning cache (`moe.cache`), so a second load profiles nothing.

FlashInfer chooses a GEMM tactic per token bucket by profiling every candidate, once per process:
measured on an H200, 66 s of the 70 s load of a GPT-OSS-120B MXFP4 layer (E=128, k=4, H=I=2880,
max_tokens=4096). `tuned_warmup` runs an experts' warm-up forward so:

- hit: the entry's tactics go into FlashInfer's autotuner (``AutoTuner.load_configs``, the loader
  behind ``flashinfer.autotune(cache=...)``) and the warm-up runs in tuning mode, which finds every
  bucket there and profiles nothing (a bucket it lacks is still profiled: never a wrong tactic);
- miss: the buckets are profiled one at a time under a progress bar, then the autotuner's results
  (``AutoTuner.save_configs``) are stored as the entry.

The entry's key adds flashinfer's version to the cache's; FlashInfer checks its own metadata on top
(CUDA, cuBLAS, GPU) and refuses a file from another environment, which counts as stale here.
Loaded tactics live in the autotuner's table of loaded files, which a ``flashinfer.autotune(cache=
...)`` entered elsewhere in the process replaces (FlashInfer's design): layers loaded after it keep
theirs; tactics profiled in this process are kept either way.
"""

from __future__ import annotations

import contextlib
import json
import logging
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from moe.cache import TuningCache, entry_key, open_cache, warn_ignored
from moe.experts._flashinfer.library import autotuning, flashinfer_module
from moe.progress import progress

FLASHINFER_LOGGER = "flashinfer.jit"  # the logger flashinfer.autotuner writes to


def autotuner() -> Any:
    """FlashInfer's process-wide ``AutoTuner``."""
    return flashinfer_module("flashinfer.autotuner").AutoTuner.get()


def tuned_warmup(experts: Any, buckets: tuple[int, ...] | None, device: torch.device,
                 run: Callable[[], None]) -> None:
    """Runs ``run`` (one warm-up forward of ``experts``) under FlashInfer's autotuner for ``buckets``
    (None: the kernel's own), with the tactics from the tuning cache when it has them, else profiling
    (a progress bar on stderr) and storing what was found."""
    cache = open_cache()
    key = entry_key(f"{experts.name}.tactics", experts.problem, buckets, device, libraries=("flashinfer",))
    if cache is not None and _loaded(cache, key):
        with quiet_flashinfer(), autotuning(buckets):
            run()
        return
    steps = buckets or (None,)  # one bucket at a time: what the bar counts
    p = experts.problem
    bar = progress(len(steps), f"tuning {experts.name} E={p.num_experts} H={p.hidden_size} I={p.intermediate_size}")
    for bucket in steps:
        with autotuning(None if bucket is None else (bucket,)):
            run()
        bar.step("" if bucket is None else f"M={bucket}")
    if cache is not None:
        cache.store(key, saved_tactics())


def _loaded(cache: TuningCache, key: dict) -> bool:
    """Loads the entry of ``key`` into the autotuner; False for a miss or an entry it refuses (warned)."""
    payload = cache.load(key)
    if payload is None:
        return False
    path = cache.path_of(key)
    if not isinstance(payload, dict):
        return _refused(path, "corrupt: its tactics are not a mapping")
    with tempfile.TemporaryDirectory() as folder, quiet_flashinfer():
        configs = Path(folder) / "tactics.json"
        configs.write_text(json.dumps(payload))
        try:
            accepted = autotuner().load_configs(str(configs))
        except (ValueError, TypeError, KeyError, IndexError, AttributeError) as error:
            return _refused(path, f"corrupt: FlashInfer cannot read its tactics ({error!r})")
    return accepted or _refused(path, "stale: FlashInfer says it was tuned in another environment "
                                      "(CUDA, cuBLAS or GPU differ)")


def saved_tactics() -> dict:
    """Every tactic FlashInfer's autotuner holds, as ``AutoTuner.save_configs`` writes them."""
    with tempfile.TemporaryDirectory() as folder, quiet_flashinfer():
        configs = Path(folder) / "tactics.json"
        autotuner().save_configs(str(configs))
        return json.loads(configs.read_text())


def _refused(path: Path, why: str) -> bool:
    warn_ignored(path, why)
    return False


@contextlib.contextmanager
def quiet_flashinfer() -> Iterator[None]:
    """FlashInfer's info lines ("Loaded N configs", "Config cache hit") held back: a load from the
    cache prints nothing. Its warnings still show."""
    logger = logging.getLogger(FLASHINFER_LOGGER)
    level = logger.level
    logger.setLevel(max(level, logging.WARNING))
    try:
        yield
    finally:
        logger.setLevel(level)
