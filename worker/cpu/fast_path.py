"""The CPU fast path: OpenBLAS in place of MLX's bundled reference BLAS, float32 weights.

MLX's Linux CPU wheel resolves ``cblas_sgemm`` from the reference BLAS it bundles (measured:
2.4 GFLOP/s for a 512x576 @ 576x1536 float32 matmul; Debian's OpenBLAS: 84-88 GFLOP/s). The
wheel loads that library privately, so a shared library named in ``LD_PRELOAD`` comes first in
symbol lookup and takes over every BLAS call: no rebuild, one environment variable per process.
``preload_env`` builds that environment for a child process; ``reexec_with_fast_blas`` lets a
worker started without it restart itself once with it.

MLX's 4-bit ``quantized_matmul`` on the CPU stays at ~2 GFLOP/s whatever the BLAS, so on the CPU
backend ``dequantize_for_cpu`` turns quantized layers back into float32 ones when the float32
model fits in a share of physical memory (the stored model stays quantized).

Nothing here applies on macOS (Metal; Accelerate is MLX's BLAS there): the Linux-only parts
return the environment unchanged. ``MLX_MESH_BLAS=/path/libopenblas.so.0`` picks the library,
``MLX_MESH_BLAS=off`` turns the preload off. The PyPI ``scipy-openblas32`` wheel cannot stand in:
it renames its symbols (``scipy_cblas_sgemm``), so MLX would never call it.

OpenBLAS's own variables pass through untouched. ``OPENBLAS_NUM_THREADS`` is best left unset:
on 2 cores, 2 threads gave 119 GFLOP/s vs 89 for one (512x576 @ 576x1536) and 9.7 vs 6.4 GB/s
for decode's one-row matmuls. ``OPENBLAS_CORETYPE`` picks the kernel family (detected: Zen; a
generic one such as Prescott was 2-4x slower), so the probe line names the family in use.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

BLAS_ENV = "MLX_MESH_BLAS"
# Set in the environment of a worker that re-executed itself, so it never does so twice.
REEXEC_MARKER = "MLX_MESH_BLAS_REEXEC"
OFF_VALUES = frozenset({"off", "0", "no", "false", "none"})
DEFAULT_DEQUANTIZE_SHARE = 0.25

# Debian/Ubuntu (libopenblas0-pthread, -openmp, -serial), then Fedora/Arch-style flat layouts.
_RELATIVE_CANDIDATES = (
    "usr/lib/{multiarch}/openblas-pthread/libopenblas.so.0",
    "usr/lib/{multiarch}/openblas-openmp/libopenblas.so.0",
    "usr/lib/{multiarch}/openblas-serial/libopenblas.so.0",
    "usr/lib/{multiarch}/libopenblas.so.0",
    "usr/lib64/libopenblas.so.0",
    "usr/lib/libopenblas.so.0",
)
# ``ldconfig -p`` tags each entry with its ABI; only entries for this machine's may be preloaded.
_LDCONFIG_ABI = {"x86_64": "x86-64", "aarch64": "AArch64"}


@dataclass(frozen=True, slots=True)
class BlasLookup:
    """Where the OpenBLAS library is, or why there is none to use."""

    path: Path | None
    reason: str | None = None  # set when path is None


def multiarch(machine: str | None = None) -> str:
    """Debian's multiarch directory name for this machine (``x86_64-linux-gnu``)."""
    return f"{machine or platform.machine()}-linux-gnu"


def _ldconfig_listing() -> str:
    try:
        done = subprocess.run(
            ["ldconfig", "-p"], capture_output=True, text=True, timeout=10, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout


def parse_ldconfig(listing: str, machine: str | None = None) -> list[Path]:
    """OpenBLAS entries of ``ldconfig -p`` output built for this machine's ABI."""
    abi = _LDCONFIG_ABI.get(machine or platform.machine())
    found = []
    for line in listing.splitlines():
        name, _, rest = line.strip().partition(" (")
        if not name.startswith("libopenblas") or " => " not in rest:
            continue
        tags, _, target = rest.partition(" => ")
        if abi is not None and "," in tags and abi not in tags:
            continue
        found.append(Path(target.strip()))
    return found


def find_openblas(
    env: Mapping[str, str] | None = None,
    *,
    root: Path = Path("/"),
    machine: str | None = None,
    ldconfig: Callable[[], str] = _ldconfig_listing,
) -> BlasLookup:
    """The OpenBLAS shared library to preload: ``$MLX_MESH_BLAS``, else the distribution's
    package paths under ``root``, else what ``ldconfig -p`` knows. ``root`` and ``ldconfig``
    exist for tests; the override is taken as given (not re-rooted)."""
    env = os.environ if env is None else env
    override = env.get(BLAS_ENV, "").strip()
    if override.lower() in OFF_VALUES:
        return BlasLookup(None, f"turned off by {BLAS_ENV}={override}")
    if override:
        path = Path(override).expanduser()
        if path.is_file():
            return BlasLookup(path)
        return BlasLookup(None, f"{BLAS_ENV}={override} is not a file")
    arch = multiarch(machine)
    for relative in _RELATIVE_CANDIDATES:
        path = root / relative.format(multiarch=arch)
        if path.is_file():
            return BlasLookup(path)
    for path in parse_ldconfig(ldconfig(), machine):
        if path.is_file():
            return BlasLookup(path)
    return BlasLookup(
        None,
        "no OpenBLAS library found (install libopenblas0-pthread, or set MLX_MESH_BLAS=PATH)",
    )


def preload_entries(value: str) -> list[str]:
    """``LD_PRELOAD``'s entries (the loader splits on spaces and colons)."""
    return [part for part in value.replace(":", " ").split() if part]


def is_preloaded(library: Path, env: Mapping[str, str]) -> bool:
    target = os.path.realpath(library)
    return any(
        os.path.realpath(entry) == target for entry in preload_entries(env.get("LD_PRELOAD", ""))
    )


def mlx_uses_cpu() -> bool:
    """Whether MLX's default device is the CPU (the Linux CPU wheel; not Metal, not CUDA)."""
    import mlx.core as mx

    return mx.default_device().type == mx.DeviceType.cpu


def preload_env(
    env: Mapping[str, str] | None = None,
    *,
    system: str | None = None,
    uses_cpu: Callable[[], bool] = mlx_uses_cpu,
    lookup: Callable[[Mapping[str, str]], BlasLookup] = find_openblas,
) -> dict[str, str]:
    """A copy of ``env`` (default: this process's) for a worker child process: with the
    OpenBLAS library put first in ``LD_PRELOAD`` on Linux when MLX runs on the CPU and the
    library is found and not turned off; otherwise the copy is unchanged. The node may pass
    the result as the ``env`` of the worker it spawns; ``python -m worker`` also applies it
    itself (``reexec_with_fast_blas``), so doing both is harmless."""
    env = dict(os.environ if env is None else env)
    if (system or sys.platform) != "linux" or not uses_cpu():
        return env
    found = lookup(env)
    if found.path is None or is_preloaded(found.path, env):
        return env
    existing = env.get("LD_PRELOAD", "").strip()
    env["LD_PRELOAD"] = f"{found.path}:{existing}" if existing else str(found.path)
    return env


def reexec_with_fast_blas(argv: list[str] | None = None) -> None:
    """Restart this process once with the OpenBLAS preload when it applies and is not in place
    (``os.execve``: same pid, same open files). Returns when there is nothing to do. Call it
    before any threads start, from a process's entry point, never from a library or a test."""
    if os.environ.get(REEXEC_MARKER):
        return  # already restarted once: whatever came of it, the probe reports it
    env = preload_env()
    if env.get("LD_PRELOAD") == os.environ.get("LD_PRELOAD"):
        return
    env[REEXEC_MARKER] = "1"
    args = list(argv if argv is not None else sys.orig_argv)
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, args, env)
    except OSError as exc:
        log.warning("cannot restart with the OpenBLAS preload (%s); running without it", exc)


# ---- what this process actually runs with ------------------------------------------------


class _DlInfo(ctypes.Structure):
    _fields_ = [
        ("dli_fname", ctypes.c_char_p),
        ("dli_fbase", ctypes.c_void_p),
        ("dli_sname", ctypes.c_char_p),
        ("dli_saddr", ctypes.c_void_p),
    ]


def sgemm_provider() -> str | None:
    """The file that this process's global symbol scope resolves ``cblas_sgemm`` to, or None.
    MLX's wheel loads its bundled BLAS privately, so without a preload there is none; with one,
    the preloaded library is the one MLX calls."""
    try:
        process = ctypes.CDLL(None)
        symbol = process.cblas_sgemm
        info = _DlInfo()
        if not process.dladdr(ctypes.cast(symbol, ctypes.c_void_p), ctypes.byref(info)):
            return None
    except (AttributeError, OSError):
        return None
    return os.fsdecode(info.dli_fname) if info.dli_fname else None


def _openblas_facts() -> tuple[str | None, int | None]:
    """OpenBLAS's chosen kernel family (``OPENBLAS_CORETYPE`` overrides it) and thread count."""
    try:
        process = ctypes.CDLL(None)
        corename = process.openblas_get_corename
        threads = process.openblas_get_num_threads
    except (AttributeError, OSError):
        return None, None
    corename.restype = ctypes.c_char_p
    name = corename()
    return (name.decode() if name else None), int(threads())


def measure_sgemm_gflops(m: int = 256, k: int = 576, n: int = 1536, reps: int = 3) -> float:
    """Best-of-``reps`` float32 matmul rate on MLX's default device (~0.1 s on the reference
    BLAS, a few ms on OpenBLAS)."""
    import mlx.core as mx

    # An explicit key: the probe must not move the global PRNG that unseeded sampling uses.
    key_a, key_b = mx.random.split(mx.random.key(0))
    a = mx.random.normal((m, k), key=key_a)
    b = mx.random.normal((k, n), key=key_b)
    mx.eval(a, b, a @ b)  # the first call pays for thread pools and page faults
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        mx.eval(a @ b)
        best = min(best, time.perf_counter() - start)
    return 2 * m * k * n / max(best, 1e-9) / 1e9


@dataclass(frozen=True, slots=True)
class BlasProbe:
    """Which BLAS MLX's matmuls run on in this process, and how fast."""

    blas: str  # "openblas", another preloaded library's name, or "reference"
    gflops: float
    fast: bool  # a BLAS other than the bundled reference one took over
    library: str | None = None
    corename: str | None = None
    threads: int | None = None
    reason: str | None = None  # why not fast

    def line(self) -> str:
        """The one line a worker prints about it at start."""
        if self.fast:
            detail = ", ".join(
                part
                for part in (
                    f"{self.corename} kernels" if self.corename else "",
                    f"{self.threads} threads" if self.threads else "",
                )
                if part
            )
            suffix = f" ({detail})" if detail else ""
            return f"cpu blas: {self.blas}{suffix}, {self.gflops:.1f} GFLOP/s ({self.library})"
        return f"cpu blas: reference, {self.gflops:.1f} GFLOP/s: fast path off: {self.reason}"


def _why_not_fast(env: Mapping[str, str]) -> str:
    found = find_openblas(env)
    if found.path is None:
        return found.reason or "no OpenBLAS library"
    if not is_preloaded(found.path, env):
        return f"{found.path} is not preloaded (start through `python -m worker`)"
    # Preloaded, yet the symbol does not resolve: a library with renamed symbols.
    return f"the preload did not take: {found.path} does not export cblas_sgemm"


def probe_blas(env: Mapping[str, str] | None = None) -> BlasProbe:
    """Measure the matmul rate and find out whether a preloaded BLAS took over."""
    env = os.environ if env is None else env
    gflops = round(measure_sgemm_gflops(), 1)
    provider = sgemm_provider()
    if provider is None:
        return BlasProbe("reference", gflops, False, reason=_why_not_fast(env))
    name = "openblas" if "openblas" in Path(provider).name else Path(provider).name
    corename, threads = _openblas_facts()
    return BlasProbe(name, gflops, True, provider, corename, threads)


_probe_lock = threading.Lock()
_probe: BlasProbe | None = None


def blas_probe() -> BlasProbe:
    """``probe_blas()`` once per process (the BLAS cannot change after start)."""
    global _probe
    with _probe_lock:
        if _probe is None:
            _probe = probe_blas()
        return _probe


# ---- float32 weights on the CPU ----------------------------------------------------------


def physical_memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _quantized_types() -> tuple[type, ...]:
    import mlx.nn as nn
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear

    return (nn.QuantizedLinear, nn.QuantizedEmbedding, QuantizedSwitchLinear)


def float32_bytes(model: Any) -> int:
    """The model's size with every weight as float32 (quantized ones unpacked)."""
    from mlx.utils import tree_flatten

    quantized = _quantized_types()
    unpacked: dict[str, int] = {}  # packed weight name → its float32 element count
    dropped: set[str] = set()  # scales and biases, gone once unpacked
    for name, module in model.named_modules():
        if isinstance(module, quantized):
            prefix = f"{name}." if name else ""
            unpacked[f"{prefix}weight"] = module.weight.size * 32 // module.bits
            dropped.update((f"{prefix}scales", f"{prefix}biases"))
    total = 0
    for name, array in tree_flatten(model.parameters()):
        if name not in dropped:
            total += unpacked.get(name, int(array.size)) * 4
    return total


@dataclass(frozen=True, slots=True)
class DequantizeResult:
    dequantized: bool
    layers: int  # quantized layers replaced
    float32_bytes: int
    limit_bytes: int | None
    reason: str | None = None  # why not, when there were quantized layers


def dequantize_for_cpu(
    model: Any, *, max_share: float = DEFAULT_DEQUANTIZE_SHARE, memory: int | None = None
) -> DequantizeResult:
    """Replace the model's quantized layers (in place) by float32 ``nn.Linear``/``nn.Embedding``
    with ``mx.dequantize``d weights when the float32 model takes at most ``max_share`` of
    physical memory (``memory`` overrides it, for tests). ``max_share <= 0`` turns it off."""
    import mlx.core as mx
    from mlx_lm.utils import dequantize_model

    quantized = _quantized_types()
    layers = sum(isinstance(m, quantized) for _, m in model.named_modules())
    size = float32_bytes(model)
    memory = physical_memory_bytes() if memory is None else memory
    limit = int(memory * max_share) if memory else None
    if layers == 0:
        return DequantizeResult(False, 0, size, limit)
    if max_share <= 0:
        return DequantizeResult(False, 0, size, limit, "turned off")
    if limit is None:
        return DequantizeResult(False, 0, size, limit, "physical memory unknown")
    if size > limit:
        reason = f"float32 size {size / 2**30:.2f} GiB exceeds {max_share:.0%} of memory"
        return DequantizeResult(False, 0, size, limit, reason)
    dequantize_model(model)
    # mx.dequantize returns the scales' dtype; the CPU wants float32 whatever they were.
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return DequantizeResult(True, layers, size, limit)


@dataclass(frozen=True, slots=True)
class CpuFastPath:
    """How a model runs on the CPU backend: which BLAS (None off Linux) and whether its
    quantized weights were unpacked to float32."""

    probe: BlasProbe | None
    dequant: DequantizeResult
    # The model modules whose prefill attention runs in numpy (worker/cpu/attention.py).
    numpy_attention: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        """The worker's ``cpu_fast_path`` entry for ``/v1/models`` and ``/health``."""
        entry: dict[str, Any] = {
            "blas": self.probe.blas if self.probe else None,
            "gflops": self.probe.gflops if self.probe else None,
            "dequantized": self.dequant.dequantized,
            "attention": "numpy" if self.numpy_attention else "mlx",
        }
        notes = [n for n in (self.probe and self.probe.reason, self.dequant.reason) if n]
        if notes:
            entry["notes"] = notes
        return entry

    def lines(self) -> list[str]:
        """What a worker prints about it once it is listening."""
        out = [self.probe.line()] if self.probe else []
        d = self.dequant
        if d.dequantized:
            out.append(
                f"cpu weights: {d.layers} quantized layers dequantized to float32 "
                f"({d.float32_bytes / 2**30:.2f} GiB)"
            )
        elif d.reason:
            out.append(f"cpu weights: kept quantized: {d.reason}")
        if self.numpy_attention:
            from worker.cpu.attention import MIN_QUERY_TOKENS

            modules = ", ".join(name.rsplit(".", 1)[-1] for name in self.numpy_attention)
            out.append(
                f"cpu attention: numpy for chunks of {MIN_QUERY_TOKENS}+ tokens, long verify"
                f" passes and batched long decode steps ({modules})"
            )
        return out


def prepare_cpu_model(model: Any, *, max_share: float = DEFAULT_DEQUANTIZE_SHARE) -> CpuFastPath:
    """Apply the CPU fast path to a model just loaded on the CPU backend (call it on the thread
    that owns the model): unpack quantized weights when they fit, probe the BLAS (Linux), and
    run its prefill attention in numpy (worker/cpu/attention.py) unless turned off."""
    from worker.cpu import attention as cpu_attention

    dequant = dequantize_for_cpu(model, max_share=max_share)
    probe = blas_probe() if sys.platform == "linux" else None
    patched = cpu_attention.install(model) if cpu_attention.enabled() else []
    return CpuFastPath(probe, dequant, tuple(patched))
