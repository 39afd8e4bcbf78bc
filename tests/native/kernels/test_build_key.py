"""The native library's build key (pagedllm/native/kernels/library.py): a cached library is
reused only while every file it was compiled from is unchanged, so each source and each header a
source includes must be part of the key."""

from __future__ import annotations

import re
from pathlib import Path

from pagedllm.native.kernels import library

CSRC = Path(library.__file__).parent / "csrc"


def test_every_source_and_included_header_keys_the_build():
    keyed = {p.name for p in library._key_files(CSRC)}
    assert {p.name for p in CSRC.glob("*.cpp")} <= keyed
    included = set()
    for path in [*CSRC.glob("*.cpp"), *CSRC.glob("*.h")]:
        included |= set(re.findall(r'^\s*#include "([^"]+)"', path.read_text(), re.MULTILINE))
    # Written into the build folder from abi.py, whose text is part of the key itself.
    included.discard("pagedllm_abi.h")
    assert included, "no #include found: the pattern above no longer matches the sources"
    missing = sorted(included - keyed)
    assert not missing, f"headers included but not part of the build key: {missing}"
