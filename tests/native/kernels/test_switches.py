"""The on/off environment switches of the CPU kernels (`kernels.switched_off`)."""

from __future__ import annotations

import pytest

from pagedllm.native.kernels import switched_off


@pytest.mark.parametrize("value, off", [("0", True), ("false", True), ("OFF", True), (" no ", True),
                                        ("1", False), ("true", False), ("On", False),
                                        ("yes", False), ("", False)])
def test_switch_values(monkeypatch, value, off):
    monkeypatch.setenv("PAGEDLLM_TEST_SWITCH", value)
    assert switched_off("PAGEDLLM_TEST_SWITCH") is off


def test_unset_is_on_and_a_typo_is_an_error(monkeypatch):
    monkeypatch.delenv("PAGEDLLM_TEST_SWITCH", raising=False)
    assert switched_off("PAGEDLLM_TEST_SWITCH") is False
    monkeypatch.setenv("PAGEDLLM_TEST_SWITCH", "disable")
    with pytest.raises(ValueError, match="PAGEDLLM_TEST_SWITCH='disable'"):
        switched_off("PAGEDLLM_TEST_SWITCH")
