"""The native ABI is written once (pagedllm/native/kernels/abi.py): every entry point the C++
sources export is declared there and nowhere else, no source keeps its own copy of an ABI
struct, and the ctypes mirrors agree with the declarations. (That each definition matches its
declaration is the compiler's check: the sources include the header made from abi.py, and a
C-linkage function defined with other parameter types does not compile.)"""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

import pytest

from pagedllm.native.kernels import abi, cpu_kernels

CSRC = Path(abi.__file__).parent / "csrc"


def _exported_definitions() -> set[str]:
    """Names of the functions defined (with a body) at the top level of `extern "C"` blocks."""
    names = set()
    for path in CSRC.glob("*.cpp"):
        text = re.sub(r"//[^\n]*", "", path.read_text())
        for block in re.finditer(r'extern "C" \{', text):
            depth, i, start = 1, block.end(), block.end()
            while depth:
                depth += {"{": 1, "}": -1}.get(text[i], 0)
                i += 1
            body = text[start:i - 1]
            for m in re.finditer(r"\b(\w+)\s*\([^()]*\)\s*\{", body):
                prefix = body[:m.start()]
                if prefix.count("{") == prefix.count("}"):
                    names.add(m.group(1))
    return names


def test_every_exported_function_is_declared_once_in_abi():
    assert _exported_definitions() == set(abi.entry_points())


def test_no_source_redeclares_an_abi_struct_or_entry_point():
    structs = set(abi._struct_fields())
    for path in [*CSRC.glob("*.cpp"), *CSRC.glob("*.h")]:
        text = path.read_text()
        for name in structs:
            assert f"struct {name} {{" not in text, f"{path.name} defines struct {name}"
        code = re.sub(r"//[^\n]*", "", text)
        for m in re.finditer(r"\b(?:void|int|double|int64_t)\s+(\w+)\s*\([^()]*\)\s*;", code):
            assert m.group(1) not in abi.entry_points(), \
                f"{path.name} declares {m.group(1)} by hand"


def test_ctypes_mirrors_follow_the_declarations():
    step = abi.struct("DecoderStep")
    assert [f for f, _ in step._fields_][:3] == ["num_tokens", "positions", "slot_mapping"]
    loop = dict(abi.struct("DecodeLoopArgs")._fields_)
    assert loop["embedding"] is abi.struct("VocabWeight")
    layer = dict(abi.struct("DecoderLayerWeights")._fields_)
    assert layer["segments"]._length_ == 4 and layer["eps"] is ctypes.c_float
    restype, argtypes = abi.entry_points()["paged_attention"]
    assert restype is None and argtypes == [ctypes.c_void_p]
    assert "#define PAGEDLLM_ABI_VERSION" in abi.c_header()


@pytest.mark.skipif(cpu_kernels() is None, reason="CPU kernels did not build")
def test_the_loaded_library_reports_this_abi_version():
    assert cpu_kernels().pagedllm_abi_version() == abi.ABI_VERSION
