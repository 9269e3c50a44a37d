"""worker/cpu/fast_path.py: finding OpenBLAS, the child-process environment, float32 weights on the CPU."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest

from worker.cpu import fast_path as cpu
from worker.testing import make_tiny_model, quantize_tiny_model

DEBIAN_X86 = "usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0"
DEBIAN_ARM = "usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0"


def _touch(root: Path, relative: str) -> Path:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\x7fELF")
    return path


def _no_ldconfig() -> str:
    return ""


# ---- finding the library -----------------------------------------------------------------


@pytest.mark.parametrize(("machine", "relative"), [("x86_64", DEBIAN_X86), ("aarch64", DEBIAN_ARM)])
def test_finds_debians_pthread_build_for_this_machine(
    tmp_path: Path, machine: str, relative: str
) -> None:
    expected = _touch(tmp_path, relative)
    _touch(tmp_path, "usr/lib64/libopenblas.so.0")  # a later candidate loses
    found = cpu.find_openblas({}, root=tmp_path, machine=machine, ldconfig=_no_ldconfig)
    assert found == cpu.BlasLookup(expected)


def test_other_architectures_library_is_not_taken(tmp_path: Path) -> None:
    _touch(tmp_path, DEBIAN_ARM)
    found = cpu.find_openblas({}, root=tmp_path, machine="x86_64", ldconfig=_no_ldconfig)
    assert found.path is None
    assert found.reason is not None and "libopenblas0-pthread" in found.reason


def test_falls_back_to_ldconfig_entries_of_this_abi(tmp_path: Path) -> None:
    arm = _touch(tmp_path, "opt/arm/libopenblas.so.0")
    x86 = _touch(tmp_path, "opt/x86/libopenblas.so.0")
    listing = (
        "3 libs found in cache `/etc/ld.so.cache'\n"
        f"\tlibblas.so.3 (libc6,x86-64) => {tmp_path}/opt/x86/libblas.so.3\n"
        f"\tlibopenblas.so.0 (libc6,AArch64) => {arm}\n"
        f"\tlibopenblas.so.0 (libc6,x86-64) => {x86}\n"
    )
    found = cpu.find_openblas({}, root=tmp_path, machine="x86_64", ldconfig=lambda: listing)
    assert found.path == x86


def test_override_wins_and_a_missing_override_says_so(tmp_path: Path) -> None:
    _touch(tmp_path, DEBIAN_X86)
    mine = _touch(tmp_path, "home/me/libopenblas.so")
    env = {cpu.BLAS_ENV: str(mine)}
    assert cpu.find_openblas(env, root=tmp_path, machine="x86_64").path == mine
    missing = cpu.find_openblas({cpu.BLAS_ENV: str(tmp_path / "nope.so")}, root=tmp_path)
    assert missing.path is None and "is not a file" in (missing.reason or "")


@pytest.mark.parametrize("value", ["off", "OFF", "0", "none"])
def test_off_switch(tmp_path: Path, value: str) -> None:
    _touch(tmp_path, DEBIAN_X86)
    found = cpu.find_openblas({cpu.BLAS_ENV: value}, root=tmp_path, machine="x86_64")
    assert found.path is None and cpu.BLAS_ENV in (found.reason or "")


# ---- the child-process environment -------------------------------------------------------


def _lookup(path: Path | None):
    return lambda env: cpu.BlasLookup(path, None if path else "none here")


def _cpu() -> bool:
    return True


def test_preload_is_prepended_to_an_existing_ld_preload(tmp_path: Path) -> None:
    lib = _touch(tmp_path, DEBIAN_X86)
    env = {"LD_PRELOAD": "/opt/libfoo.so /opt/libbar.so", "HOME": "/h"}
    out = cpu.preload_env(env, system="linux", uses_cpu=_cpu, lookup=_lookup(lib))
    assert out["LD_PRELOAD"] == f"{lib}:/opt/libfoo.so /opt/libbar.so"
    assert out["HOME"] == "/h"
    assert env["LD_PRELOAD"] == "/opt/libfoo.so /opt/libbar.so"  # the input is not changed
    # Applying it twice (node sets it, the worker checks again) adds nothing.
    again = cpu.preload_env(out, system="linux", uses_cpu=_cpu, lookup=_lookup(lib))
    assert again == out


def test_preload_without_an_existing_ld_preload(tmp_path: Path) -> None:
    lib = _touch(tmp_path, DEBIAN_X86)
    out = cpu.preload_env({}, system="linux", uses_cpu=_cpu, lookup=_lookup(lib))
    assert out == {"LD_PRELOAD": str(lib)}


def test_off_switch_leaves_the_environment_alone(tmp_path: Path) -> None:
    env = {cpu.BLAS_ENV: "off", "LD_PRELOAD": "/opt/libfoo.so"}
    lookup = lambda e: cpu.find_openblas(e, root=tmp_path)  # noqa: E731
    _touch(tmp_path, DEBIAN_X86)
    assert cpu.preload_env(env, system="linux", uses_cpu=_cpu, lookup=lookup) == env


def test_not_linux_or_not_cpu_is_a_no_op(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lib = _touch(tmp_path, DEBIAN_X86)
    env = {"PATH": "/bin"}
    for system in ("darwin", "win32"):
        assert cpu.preload_env(env, system=system, uses_cpu=_cpu, lookup=_lookup(lib)) == env
    gpu = cpu.preload_env(env, system="linux", uses_cpu=lambda: False, lookup=_lookup(lib))
    assert gpu == env
    # The default platform check reads sys.platform.
    monkeypatch.setattr(cpu.sys, "platform", "darwin")
    assert cpu.preload_env(env, uses_cpu=_cpu, lookup=_lookup(lib)) == env
    assert cpu.preload_env(env, system="linux", uses_cpu=_cpu, lookup=_lookup(None)) == env


def test_preload_entries_split_like_the_loader() -> None:
    assert cpu.preload_entries(" a.so:b.so  c.so ") == ["a.so", "b.so", "c.so"]
    assert cpu.preload_entries("") == []


# ---- float32 weights ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def quantized_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return quantize_tiny_model(make_tiny_model(tmp_path_factory.mktemp("tiny-q4") / "model"))


def _load(path: Path) -> nn.Module:
    from mlx_lm import load

    model, _ = load(str(path))
    model.set_dtype(mx.float32)
    return model


def _kinds(model: nn.Module) -> set[str]:
    return {type(m).__name__ for _, m in model.named_modules()}


def test_dequantized_model_gives_the_quantized_models_logits(quantized_dir: Path) -> None:
    model = _load(quantized_dir)
    assert {"QuantizedLinear", "QuantizedEmbedding"} <= _kinds(model)
    tokens = mx.array([[5, 17, 42, 99, 7, 3, 250, 11]])
    before = model(tokens)
    result = cpu.dequantize_for_cpu(model, max_share=0.25, memory=1 << 30)
    after = model(tokens)
    assert result.dequantized and result.layers == 2 * 7 + 2  # 7 per block, embed, lm_head
    assert not {"QuantizedLinear", "QuantizedEmbedding"} & _kinds(model)
    assert all(a.dtype == mx.float32 for _, a in _flat(model))
    assert mx.abs(after - before).max().item() < 1e-3 * max(1.0, mx.abs(before).max().item())
    # Same next-token choice everywhere: the models are the same function.
    assert mx.array_equal(after.argmax(-1), before.argmax(-1)).item()


def _flat(model: nn.Module):
    from mlx.utils import tree_flatten

    return tree_flatten(model.parameters())


def test_float32_size_counts_unpacked_weights(quantized_dir: Path) -> None:
    model = _load(quantized_dir)
    predicted = cpu.float32_bytes(model)
    cpu.dequantize_for_cpu(model, memory=1 << 40)
    assert predicted == sum(a.nbytes for _, a in _flat(model))


def test_model_too_big_for_the_share_stays_quantized(quantized_dir: Path) -> None:
    model = _load(quantized_dir)
    size = cpu.float32_bytes(model)
    result = cpu.dequantize_for_cpu(model, max_share=0.25, memory=4 * size - 4)
    assert not result.dequantized and "exceeds 25% of memory" in (result.reason or "")
    assert "QuantizedLinear" in _kinds(model)
    off = cpu.dequantize_for_cpu(model, max_share=0.0, memory=1 << 40)
    assert not off.dequantized and off.reason == "turned off"


def test_unquantized_model_has_nothing_to_do(tiny_model_dir: Path) -> None:
    result = cpu.dequantize_for_cpu(_load(tiny_model_dir), memory=1 << 40)
    assert result == cpu.DequantizeResult(False, 0, result.float32_bytes, 1 << 38)
    assert cpu.CpuFastPath(None, result).as_dict() == {
        "blas": None,
        "gflops": None,
        "dequantized": False,
        "attention": "mlx",
    }


def test_fast_path_entry_says_why_not() -> None:
    probe = cpu.BlasProbe("reference", 2.4, False, reason="no OpenBLAS library found")
    dequant = cpu.DequantizeResult(False, 0, 10, 1, reason="float32 size exceeds")
    path = cpu.CpuFastPath(probe, dequant)
    assert path.as_dict() == {
        "blas": "reference",
        "gflops": 2.4,
        "dequantized": False,
        "attention": "mlx",
        "notes": ["no OpenBLAS library found", "float32 size exceeds"],
    }
    assert path.lines() == [
        "cpu blas: reference, 2.4 GFLOP/s: fast path off: no OpenBLAS library found",
        "cpu weights: kept quantized: float32 size exceeds",
    ]
