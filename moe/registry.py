"""Where backends register themselves: a decorator for this package's classes and the
``moe.backends`` entry-point group for plugins.

A plugin package declares, in its pyproject.toml::

    [project.entry-points."moe.backends"]
    my_backend = "my_package.experts"      # a module whose import registers its classes

Nothing else in `moe` lists the backends; the oracle, the CLI's support table and the test matrix
iterate this registry.

Backends also declare here what they know about the libraries they call (``register_library``): a
probe that lists the features an installation has, and what a simulated platform with the library
assumes (features, version). `moe.platform` keeps these declarations and `Platform` reads them, so the
platform layer names no backend module and imports nothing above it.

A broken plugin cannot take the library down: an entry point whose import raises (a registration
refused for its declarations included) is skipped whole, and a plugin class whose ``check`` raises is
rejected with that as its reason (``checked_reasons``); each gets one ``BrokenPluginWarning`` naming
the plugin, its distribution and the error, and ``broken_backends()`` lists them for ``moe backends``.
"""

from __future__ import annotations

import importlib
import warnings
from importlib.metadata import entry_points, packages_distributions
from typing import Any, TypeVar

from moe.errors import MoEConfigError
from moe.platform import LibrarySupport, declare_library

T = TypeVar("T", bound=type)

_EXPERTS: dict[str, type] = {}
_PREPARE_FINALIZE: dict[str, type] = {}
_BROKEN: dict[str, str] = {}  # plugin (entry point or backend name) -> why it is skipped or rejected
_ORIGIN: dict[type, tuple[str, str]] = {}  # plugin class -> (entry point, distribution) it came through
# modules of this package that register backends; imported lazily so that `import moe` stays light
_BUILTIN_MODULES = (
    "moe.experts",
    "moe.prepare_finalize",
)
_loaded = False


class BrokenPluginWarning(RuntimeWarning):
    """A ``moe.backends`` plugin is skipped or rejected because of an error in its own code."""


def _register(table: dict[str, type], kind: str, cls: T) -> T:
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name:
        raise MoEConfigError(f"{kind} class {cls.__qualname__} needs a class attribute `name` (a non-empty str)")
    problems = _DECLARATION_PROBLEMS[kind](cls)
    if problems:
        raise MoEConfigError(f"{kind} class {cls.__module__}.{cls.__qualname__} ({name!r}) cannot be registered: "
                             + "; ".join(problems))
    existing = table.get(name)
    if existing is not None and existing is not cls:
        raise MoEConfigError(
            f"{kind} name {name!r} is already registered by {existing.__module__}.{existing.__qualname__}; "
            f"pick another name for {cls.__module__}.{cls.__qualname__}"
        )
    table[name] = cls
    return cls


def register_experts(cls: T) -> T:
    """Class decorator: makes an Experts subclass known to the oracle under ``cls.name``.

    Raises MoEConfigError when ``cls`` is no Experts subclass, its ``capabilities`` is missing or
    malformed (what the oracle, the CLI and the test matrix read), or it defines no ``declared_workspace``."""
    return _register(_EXPERTS, "Experts", cls)


def register_prepare_finalize(cls: T) -> T:
    """Class decorator: makes a PrepareFinalize subclass known to the oracle under ``cls.name``.

    Raises MoEConfigError when ``cls`` is no PrepareFinalize subclass or its ``transport`` is missing
    or malformed (its ``format``, ``quant_formats`` or ``implemented`` of the wrong type, ...)."""
    return _register(_PREPARE_FINALIZE, "PrepareFinalize", cls)


def register_library(support: LibrarySupport) -> LibrarySupport:
    """Declares what the backends know of ``support.library`` (a `moe.platform.LibrarySupport`): its
    feature probe, and the features and version a simulated platform with it assumes. The built-in
    backends declare theirs when `moe` is imported, a plugin when its entry point loads: a platform
    detected before that (``Platform.detect`` caches) does not see the plugin's probe. MoEConfigError
    when another declaration holds that library."""
    return declare_library(support)


# --- declarations --------------------------------------------------------------------------------
# The bases are imported when a class registers, not at the top: the modules that define them import
# this one, and a class registering has already imported its base.
_MISSING = object()


def _all(values: Any, ok) -> bool:
    return isinstance(values, (frozenset, set, tuple, list)) and all(ok(v) for v in values)


def _experts_problems(cls: type) -> list[str]:
    from moe.activation import ActivationKind
    from moe.experts.base import Capabilities, Experts, Mode
    from moe.formats import ActivationFormat, OutputKind

    if not (isinstance(cls, type) and issubclass(cls, Experts)):
        return ["it is not a subclass of moe.Experts"]
    cap = getattr(cls, "capabilities", _MISSING)
    if cap is _MISSING:
        return ["it has no `capabilities` (a moe.Capabilities saying what it serves)"]
    if not isinstance(cap, Capabilities):
        return [f"`capabilities` must be a moe.Capabilities, not {type(cap).__name__}"]
    not_modes = [m for m in cap.modes.values() if not isinstance(m, Mode)]
    if not_modes:  # the derived fields read the modes
        return [f"capabilities.modes must map each QuantScheme to a moe.Mode (got {not_modes[0]!r})"]
    fields = (("formats", "ActivationFormat members", lambda v: isinstance(v, ActivationFormat)),
              ("activations", "ActivationKind members", lambda v: isinstance(v, ActivationKind)),
              ("devices", "device names (str)", lambda v: isinstance(v, str)),
              ("libraries", "library names (str)", lambda v: isinstance(v, str)))
    problems = [f"capabilities.{field} must be a collection of {what} (got {getattr(cap, field)!r})"
                for field, what, ok in fields if not _all(getattr(cap, field), ok)]
    if not isinstance(cap.output, OutputKind):
        problems.append(f"capabilities.output must be an OutputKind (got {cap.output!r})")
    if getattr(cls.declared_workspace, "__func__", None) is Experts.declared_workspace.__func__:
        problems.append("it defines no classmethod `declared_workspace(problem, dispatch)` (its buffers, "
                        "which the oracle sizes a plan's workspace with, building nothing)")
    return problems


def _prepare_finalize_problems(cls: type) -> list[str]:
    from moe.formats import ActivationFormat
    from moe.prepare_finalize import base  # one import of the base the registering class imported already
    from moe.quant import QuantFormat

    if not (isinstance(cls, type) and issubclass(cls, base.PrepareFinalize)):
        return ["it is not a subclass of moe.prepare_finalize.base.PrepareFinalize"]
    transport = getattr(cls, "transport", _MISSING)
    if not isinstance(transport, base.Transport):
        got = "none" if transport is _MISSING else type(transport).__name__
        return [f"`transport` must be a moe.prepare_finalize.base.Transport saying what it serves (got {got})"]
    fields = (("ranks", "Ranks members", lambda v: isinstance(v, base.Ranks)),
              ("devices", "device names (str)", lambda v: isinstance(v, str)),
              ("libraries", "library names (str)", lambda v: isinstance(v, str)))
    problems = [f"transport.{field} must be a collection of {what} (got {getattr(transport, field)!r})"
                for field, what, ok in fields if not _all(getattr(transport, field), ok)]
    declared = (("format", "an ActivationFormat", lambda v: isinstance(v, ActivationFormat)),
                ("quant_formats", "a collection of QuantFormat members",
                 lambda v: _all(v, lambda q: isinstance(q, QuantFormat))),
                ("implemented", "a bool", lambda v: isinstance(v, bool)))
    for attr, what, ok in declared:  # named as a subclass may refine them: class attributes
        value = getattr(transport, attr)
        if not ok(value):
            problems.append(f"`{attr}` must be {what} (got {value!r})")
    return problems


_DECLARATION_PROBLEMS = {"Experts": _experts_problems, "PrepareFinalize": _prepare_finalize_problems}


# --- loading -------------------------------------------------------------------------------------
def load_backends() -> None:
    """Imports the built-in backend modules and every ``moe.backends`` entry point (once).

    An entry point whose import raises is skipped whole -- what it registered before raising is
    withdrawn -- with one BrokenPluginWarning, and listed by ``broken_backends()``. The built-in
    modules are not guarded: an error there is this package's bug and surfaces."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    for module in _BUILTIN_MODULES:
        importlib.import_module(module)
    for ep in entry_points(group="moe.backends"):
        _load_plugin(ep)


def _load_plugin(ep) -> None:
    """Imports one entry point; remembers where its classes came from, or withdraws them if it raises."""
    tables = (_EXPERTS, _PREPARE_FINALIZE)
    saved = [dict(table) for table in tables]
    dist = _distribution(ep.dist.name if getattr(ep, "dist", None) is not None else None, ep.value)
    # Another package's import is not ours to fix, and it must not stop `moe` from working with the
    # backends it does have: say what broke and whose it is, and go on without it.
    try:
        ep.load()
    except Exception as error:
        for table, old in zip(tables, saved):
            table.clear()
            table.update(old)
        _mark_broken(ep.name, f"import failed, {type(error).__name__}: {error} (plugin {ep.name!r} = {ep.value!r} "
                              f"from distribution {dist}; report it to its authors)", "skipped")
        return
    for table, old in zip(tables, saved):
        for name, cls in table.items():
            if name not in old:
                _ORIGIN[cls] = (ep.name, dist)


def _distribution(name: str | None, module: str) -> str:
    """``name`` quoted, or the distribution that installed ``module``'s top-level package."""
    if name is None:
        found = packages_distributions().get(module.split(".")[0].split(":")[0], [])
        name = ", ".join(found) if found else None
    return repr(name) if name else "unknown (not installed as a distribution)"


def _mark_broken(name: str, reason: str, consequence: str) -> None:
    """Records ``name`` as broken; warns the first time only."""
    if name not in _BROKEN:
        warnings.warn(f"moe backend plugin {name!r} is broken ({consequence}): {reason}", BrokenPluginWarning,
                      stacklevel=3)
        _BROKEN[name] = reason


def is_builtin(cls: type) -> bool:
    """True for classes defined inside the `moe` package itself (not by a plugin)."""
    return cls.__module__ == "moe" or cls.__module__.startswith("moe.")


def checked_reasons(cls: type, problem: Any, platform: Any) -> list[str]:
    """``cls.check(problem, platform)``, where a plugin's check that raises becomes one reason naming
    the plugin and its distribution (with one BrokenPluginWarning, and a ``broken_backends()`` entry)."""
    return checked_call(cls, "check", problem, platform)


def checked_call(cls: type, method: str, *args: Any) -> list[str]:
    """``list(cls.<method>(*args))`` for a method that returns reasons, guarded as ``checked_reasons``."""
    call = getattr(cls, method)
    if is_builtin(cls):
        return list(call(*args))
    # The oracle never catches an exception to filter a candidate (STYLE.md): a bug in this package's
    # own check must surface, so the classes of `moe` are called unguarded above. A plugin's bug is
    # not ours to fix and must not take every layer down with it: its exception becomes its reason.
    try:
        return list(call(*args))
    except Exception as error:
        entry, dist = _ORIGIN.get(cls, (None, None))
        plugin = f"plugin {entry!r}, " if entry else ""
        dist = dist or _distribution(None, cls.__module__)
        reason = (f"{method} raised {type(error).__name__}: {error} ({plugin}class {cls.__module__}.{cls.__qualname__} "
                  f"from distribution {dist}; report it to its authors)")
        _mark_broken(cls.name, reason, f"rejected wherever its {method} raises")
        return [reason]


def broken_backends() -> dict[str, str]:
    """Plugins skipped (their import raised) or rejected (their check raised), by name, with why."""
    load_backends()
    return dict(_BROKEN)


def experts_classes() -> dict[str, type]:
    """Registered Experts classes by name, in registration order."""
    load_backends()
    return dict(_EXPERTS)


def prepare_finalize_classes() -> dict[str, type]:
    load_backends()
    return dict(_PREPARE_FINALIZE)


def get_experts(name: str) -> type:
    classes = experts_classes()
    if name not in classes:
        raise MoEConfigError(f"unknown experts backend {name!r}; registered: {sorted(classes)}")
    return classes[name]


def get_prepare_finalize(name: str) -> type:
    classes = prepare_finalize_classes()
    if name not in classes:
        raise MoEConfigError(f"unknown prepare/finalize {name!r}; registered: {sorted(classes)}")
    return classes[name]
