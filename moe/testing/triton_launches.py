"""Triton launches recorded on the CPU, then compiled for real GPUs: what only a GPU compile rejects.

Triton's CPU interpreter (``TRITON_INTERPRET=1``) runs a kernel's Python as Python, so it accepts code
that Triton compiling for a GPU refuses: a global that is a plain Python value rather than a
``tl.constexpr``, or a helper whose ``if CONSTEXPR: return a`` is followed by code returning another
type (the GPU frontend type-checks both). Triton compiles for a GPU target without a GPU (frontend
and the ``ptxas`` of its wheel), so a CPU test can run the GPU's compiler on the launches the
interpreter ran:

1. `record_launches` records every ``kernel[grid](...)`` launch made inside it as a `LaunchRecord`:
   the kernel, the Triton type of each runtime argument, the constexpr values, the launch options, and
   which arguments a GPU launch would specialize as multiples of 16 (ints, tensor addresses): the hint
   that lets Triton vectorize and software-pipeline loads. Without it the compiled K loops are not the
   GPU's (the fp8 decode GEMM's weights were plain loads, not a ``cp.async`` ring).
2. `compile_jobs` makes each distinct record `CompileJob`s: the launch as recorded and, for a record
   with float16 tensors, the same launch in bfloat16 (what a GPU model runs; the interpreter
   computes bfloat16 wrongly, so no CPU test launches it); for sm90, and for sm80 unless the
   launch needs fp8 tensor cores or TMA (`runs_on_sm80`); a full compile (through ptxas) or the
   frontend only (Triton IR), as `compile_jobs` says.
3. `Compiler` compiles the jobs in worker processes that import the kernels compiled, not
   interpreted (``triton.jit`` decides when it decorates), while more launches are recorded, and
   returns each job's error, if any.

`jit_functions` and `unreached` find every ``@triton.jit`` function in the sources and those that no
recorded kernel launches or calls, so a new kernel without a recorded launch cannot go unchecked.
"""

from __future__ import annotations

import ast
import contextlib
import inspect
import multiprocessing
import os
import re
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

Items = tuple[tuple[str, object], ...]  # (name, value) pairs, in the kernel's parameter order


@dataclass(frozen=True)
class LaunchRecord:
    """One launch as the GPU compiler needs it (values of runtime arguments left out: one compile
    serves them all, so launches that differ only there are one record)."""

    module: str  # the kernel's module, e.g. "moe.experts._triton._rows"
    kernel: str  # the ``@triton.jit`` function's name, e.g. "combine_kernel"
    signature: Items  # (parameter, Triton type) of each runtime argument: "*fp16", "i32", "fp32", ...
    constexprs: Items  # (parameter, value) of each ``tl.constexpr`` parameter
    options: Items  # launch options (num_warps, num_stages) as given; absent ones take Triton's defaults
    divisible: tuple[str, ...] = ()  # runtime arguments a launch specializes as multiples of 16 (`divisible_by_16`)

    @property
    def name(self) -> str:
        return f"{self.module}.{self.kernel}"

    def describe(self) -> str:
        """The kernel, its constexprs, its pointer types and its options, on one line (for failures)."""
        pointers = ",".join(t for _, t in self.signature if not t[0].isalpha() or t.startswith("tensordesc"))
        switches = " ".join(f"{k}={v}" for k, v in self.constexprs + self.options)
        return f"{self.kernel}[{pointers}] {switches}"


@dataclass(frozen=True)
class CompileJob:
    """A record to compile for one GPU architecture (compute capability ``arch``: 90 = H100)."""

    record: LaunchRecord
    arch: int
    full: bool = True  # through ptxas to a cubin; False: the frontend only (Triton IR)

    def describe(self) -> str:
        return f"sm{self.arch}{'' if self.full else ' frontend'} {self.record.describe()}"


def _is_constexpr(parameter: inspect.Parameter) -> bool:
    # as triton.runtime.jit.KernelParam reads it: the annotation names constexpr (object or string)
    return "constexpr" in str(parameter.annotation)


def divisible_by_16(value) -> bool:
    """Whether a launch specializes this runtime argument as a multiple of 16 (Triton's ``tt.divisibility``
    16): an int (not a bool) that is one, or a tensor whose address is (a GPU allocation always is; a view
    may not be). Ints equal to 1, which a launch also turns into constants, stay arguments here."""
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return value % 16 == 0
    data_ptr = getattr(value, "data_ptr", None)
    return data_ptr is not None and data_ptr() % 16 == 0


def launch_record(fn, args: tuple, kwargs: dict, do_not_specialize=()) -> LaunchRecord:
    """The `LaunchRecord` of ``fn[grid](*args, **kwargs)`` (``fn``: the Python function under the
    ``@triton.jit``); types by Triton's own mapping (``mangle_type``), as its launcher specializes, and
    the arguments it would specialize as multiples of 16, but for ``do_not_specialize`` (the decorator's
    names or positions)."""
    from triton.runtime.jit import mangle_type  # noqa: PLC0415 (triton only where used)

    parameters = inspect.signature(fn).parameters
    bound = inspect.signature(fn).bind(*args, **{k: v for k, v in kwargs.items() if k in parameters})
    bound.apply_defaults()
    signature, constexprs, divisible = [], [], []
    for position, (name, parameter) in enumerate(parameters.items()):
        value = bound.arguments[name]
        if _is_constexpr(parameter):
            constexprs.append((name, value))
            continue
        signature.append((name, mangle_type(value)))
        if divisible_by_16(value) and name not in do_not_specialize and position not in do_not_specialize:
            divisible.append(name)
    options = tuple((k, v) for k, v in kwargs.items() if k not in parameters)
    return LaunchRecord(fn.__module__, fn.__name__, tuple(signature), tuple(constexprs), options, tuple(divisible))


@contextlib.contextmanager
def record_launches():
    """Within the block, every ``kernel[grid](...)`` launch appends its `LaunchRecord` to the yielded
    list, then runs as it would have. Patches ``KernelInterface.__getitem__`` (what the interpreted
    and the compiled kernels share) for the block's duration; not thread-safe."""
    from triton.runtime.jit import KernelInterface  # noqa: PLC0415

    records: list[LaunchRecord] = []
    original = KernelInterface.__getitem__

    def getitem(kernel, grid):
        launch = original(kernel, grid)

        def recorded(*args, **kwargs):
            # a compiled JITFunction keeps the decorator's list as an attribute, the interpreter's in its kwargs
            unspecialized = getattr(kernel, "do_not_specialize", None) or \
                getattr(kernel, "kwargs", {}).get("do_not_specialize") or ()
            records.append(launch_record(kernel.fn, args, kwargs, tuple(unspecialized)))
            return launch(*args, **kwargs)

        return recorded

    KernelInterface.__getitem__ = getitem
    try:
        yield records
    finally:
        KernelInterface.__getitem__ = original


# constexpr switches that only a bfloat16 launch on a GPU turns on (the decode kernels' packed bf16x2 PTX
# dequantization): the bfloat16 twin of a CPU launch compiles with them on
GPU_ONLY_SWITCHES = {"moe.experts._triton._decode.decode_gemm_kernel": {"ASM": True}}


def bfloat16_twin(record: LaunchRecord) -> LaunchRecord | None:
    """``record`` with its float16 tensors in bfloat16, or None when it has none. float16 stands for
    the model's dtype in CPU runs (activations, outputs, dense weights); scales and router weights
    are float32 in both, and a float32 run is a float32 model (kept as it is). `GPU_ONLY_SWITCHES`
    are set in the twin."""
    if not any("fp16" in t for _, t in record.signature):
        return None
    switches = GPU_ONLY_SWITCHES.get(record.name, {})
    return replace(record, signature=tuple((n, t.replace("fp16", "bf16")) for n, t in record.signature),
                   constexprs=tuple((n, switches.get(n, v)) for n, v in record.constexprs))


def _types(record: LaunchRecord) -> str:
    return " ".join(t for _, t in record.signature)


def sm80_variant(record: LaunchRecord) -> LaunchRecord:
    """``record`` as an A100 would launch it: the FMA decode tiles' PTX, which converts from e4m3 (SM89+),
    off (`decode.tile_asm`)."""
    constexprs = dict(record.constexprs)
    if record.name == "moe.experts._triton._decode.decode_gemm_kernel" and constexprs.get("ASM") and \
            not constexprs.get("DOT"):
        return replace(record, constexprs=tuple((n, False if n == "ASM" else v) for n, v in record.constexprs))
    return record


def runs_on_sm80(record: LaunchRecord) -> bool:
    """False where the launch needs SM89+ or SM90+: fp8 tensors (e4m3 tensor cores; an A100 gets fp8
    weights as uint8, weight-only) or a TMA descriptor."""
    types = _types(record)
    return "fp8" not in types and "tensordesc" not in types


def compile_jobs(records) -> list[CompileJob]:
    """The distinct records' `CompileJob`s, each once, in a stable order. The GPU variant of a record
    (its `bfloat16_twin` if it has float16 tensors, else itself) compiles fully for sm90; the float16
    original goes through sm90's frontend, where the faults above are found (a full compile costs ~20
    frontends: 0.4 s against 0.02 s). Where it `runs_on_sm80`, the GPU variant also goes through
    sm80's frontend (where Triton refuses what an arch lacks, e.g. e4m3), fully when it reads uint8
    tensors: dequantization in registers, whose conversions lower per arch (as `sm80_variant`: what an A100
    would launch)."""
    jobs = {}
    for record in records:
        twin = bfloat16_twin(record)
        if twin is not None:
            jobs[CompileJob(record, 90, full=False)] = None
        gpu = twin or record
        jobs[CompileJob(gpu, 90)] = None
        a100 = sm80_variant(gpu)
        if runs_on_sm80(a100):
            jobs[CompileJob(a100, 80, full="*u8" in _types(a100))] = None
    return list(jobs)


def _compile_mode(paths: list[str]) -> None:
    """A `Compiler` worker's start: kernels imported from now on are compiled, not interpreted."""
    os.environ["TRITON_INTERPRET"] = "0"
    sys.path[:0] = [p for p in paths if p not in sys.path]


def compile_one(job: CompileJob) -> str | None:
    """Compiles ``job`` for its architecture with the installed Triton (no GPU needed); None, or the
    error as ``Type: message``. Must run where TRITON_INTERPRET is off (a `Compiler` worker)."""
    return _compile(job)[0]


def compile_stage(job: CompileJob, kind: str = "ttgir") -> tuple[str | None, str]:
    """`compile_one`'s result and, for a full compile that succeeded, one stage of the kernel (``kind``: "ttgir",
    Triton's GPU IR with its tensors' layouts; "ptx"; ...); else ""."""
    return _compile(job, kind)


def _compile(job: CompileJob, kind: str = "ttgir") -> tuple[str | None, str]:
    import importlib  # noqa: PLC0415

    import triton  # noqa: PLC0415
    from triton.backends.compiler import GPUTarget  # noqa: PLC0415
    from triton.compiler import ASTSource  # noqa: PLC0415

    record = job.record
    fn = getattr(importlib.import_module(record.module), record.kernel)
    assert isinstance(fn, triton.runtime.JITFunction), f"{record.name} is {type(fn).__name__}: interpreted?"
    signature = dict(record.signature) | {name: "constexpr" for name, _ in record.constexprs}
    constexprs = {(fn.arg_names.index(name),): value for name, value in record.constexprs}
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in record.divisible}
    source = ASTSource(fn=fn, signature={n: signature[n] for n in fn.arg_names}, constexprs=constexprs, attrs=attrs)
    target = GPUTarget("cuda", job.arch, 32)
    try:
        if job.full:
            return None, triton.compile(source, target=target, options=dict(record.options)).asm[kind]
        _frontend(source, target, dict(record.options))
    except Exception as error:  # noqa: BLE001 -- reported per job, with the launch that caused it
        return _chain(error), ""
    return None, ""


def _chain(error: BaseException) -> str:
    """``Type: message`` of ``error`` and of each error it was raised from (Triton 3.6 puts the cause,
    e.g. the mismatched return types, only there)."""
    parts = []
    while error is not None and len(parts) < 5:
        parts.append(f"{type(error).__name__}: {error}")
        error = error.__cause__ or error.__context__
    return "\ncaused by ".join(parts)


def _frontend(source, target, options: dict) -> None:
    """What `triton.compile` runs first: the Python AST to Triton IR (type checks included)."""
    from triton._C.libtriton import ir  # noqa: PLC0415
    from triton.compiler.compiler import make_backend  # noqa: PLC0415

    backend = make_backend(target)
    options = backend.parse_options(options)
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    source.make_ir(target, options, backend.get_codegen_implementation(options), backend.get_module_map(), context)


class Compiler:
    """Compiles `CompileJob`s in ``workers`` fresh processes while the caller goes on (recording more
    launches): spawned, so the kernels import there in compile mode whatever this process's
    TRITON_INTERPRET. ``paths`` go first on their ``sys.path`` (modules outside the installed ones)."""

    def __init__(self, workers: int = 2, paths: tuple[str, ...] = ()):
        self._pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                                         initializer=_compile_mode, initargs=(list(paths),))
        self._futures = {}

    def __enter__(self) -> "Compiler":
        return self

    def __exit__(self, *exc) -> None:
        self._pool.shutdown(cancel_futures=True)

    def submit(self, records) -> None:
        """Queues the `compile_jobs` of ``records`` not queued before."""
        for job in compile_jobs(records):
            if job not in self._futures:
                self._futures[job] = self._pool.submit(compile_one, job)

    def stage(self, job: CompileJob, kind: str = "ttgir"):
        """A future of `compile_stage` (``job`` is not among `results`)."""
        return self._pool.submit(compile_stage, job, kind)

    def results(self) -> dict:
        """``{job: error or None}`` of every job queued, once all are done."""
        return {job: future.result() for job, future in self._futures.items()}


# --- which @triton.jit functions exist, and which the recorded kernels reach ---------------------

_JIT = re.compile(r"(^|\.)jit($|\()")  # @triton.jit, @triton.jit(...), @jit


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _bindings(tree: ast.Module, module: str) -> dict[str, str]:
    """Each name the module's imports and defs bind -> its dotted target ("pkg.mod.name")."""
    names = {node.name: f"{module}.{node.name}" for node in tree.body if isinstance(node, ast.FunctionDef)}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.update({a.asname or a.name: f"{node.module}.{a.name}" for a in node.names})
        elif isinstance(node, ast.Import):
            names.update({a.asname or a.name: a.name for a in node.names})
    return names


def _named(fn: ast.FunctionDef, bindings: dict[str, str]) -> set[str]:
    """The dotted targets of the names (``f``, ``mod.f``) that ``fn``'s body reads."""
    found = set()
    for node in ast.walk(fn):
        if isinstance(node, ast.Name) and node.id in bindings:
            found.add(bindings[node.id])
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bindings:
            found.add(f"{bindings[node.value.id]}.{node.attr}")
    return found


def jit_functions(root: Path) -> dict[str, set[str]]:
    """Every ``@triton.jit`` function in the package at ``root`` ("pkg.mod.name") -> the
    ``@triton.jit`` functions its body names (calls them, or passes them, as to ``tl.reduce``)."""
    graph = {}
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text())
        module = _module_name(path, root)
        bindings = _bindings(tree, module)
        for fn in tree.body:
            if not isinstance(fn, ast.FunctionDef):
                continue
            decorators = [ast.unparse(d) for d in fn.decorator_list]
            # Gluon kernels (@gluon.jit) do not run under the interpreter, so no scenario can record them:
            # tests/test_triton_wgmma.py compiles them for sm90 instead
            if any(_JIT.search(d) and not d.startswith("gluon.") for d in decorators):
                graph[f"{module}.{fn.name}"] = _named(fn, bindings)
    return {name: {n for n in names if n in graph and n != name} for name, names in graph.items()}


def unreached(graph: dict[str, set[str]], launched) -> list[str]:
    """The functions of ``graph`` (`jit_functions`) that neither a ``launched`` kernel ("pkg.mod.name")
    is nor one calls, directly or through others."""
    reached, todo = set(), [name for name in launched if name in graph]
    while todo:
        name = todo.pop()
        if name not in reached:
            reached.add(name)
            todo.extend(graph[name])
    return sorted(set(graph) - reached)
