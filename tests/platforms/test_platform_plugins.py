"""Platform plugins (`pagedllm.platform_plugins` entry points) end to end.

Each test installs a throwaway package and a `*.dist-info/entry_points.txt` into a temporary
folder on sys.path, which `importlib.metadata` reads like any installed distribution. The fake
platform subclasses `CpuPlatform` and brings its own attention backend ("fake_cpu_sdpa", the SDPA
backend counting its calls), so the tests can tell it was chosen and used. Oracle for generation:
the built-in CPU platform with the same (torch_sdpa) attention math gives the same greedy tokens.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from pagedllm.attention.backends.selector import get_attention_backend
from pagedllm.platforms import current_platform, get_current_platform, reset_current_platform
from pagedllm.platforms.cpu import CpuPlatform
from pagedllm.platforms.plugins import PlatformPluginError

PKG = "pagedllm_fake_platform_pkg"

_PACKAGE_SOURCE = f'''
def cpu_fake():
    return "{PKG}.platform.FakeCpuPlatform"

def cpu_fake_two():
    return "{PKG}.platform.OtherFakeCpuPlatform"

def unavailable():
    return None

def raises():
    raise RuntimeError("driver not loaded")

def missing_class():
    return "{PKG}.platform.NoSuchPlatform"

def not_a_platform():
    return "{PKG}.platform.NotAPlatform"

def not_a_string():
    return 42
'''

_PLATFORM_SOURCE = '''
from pagedllm.attention.backends.torch_sdpa import TorchSDPABackend
from pagedllm.platforms.cpu import CpuPlatform

FORWARD_CALLS = []


class FakeSDPABackend(TorchSDPABackend):
    name = "fake_cpu_sdpa"

    @staticmethod
    def forward(*args, **kwargs):
        FORWARD_CALLS.append(1)
        return TorchSDPABackend.forward(*args, **kwargs)


class FakeCpuPlatform(CpuPlatform):
    def attention_backend_name(self):
        return FakeSDPABackend.name

    def get_attention_backend_cls(self):
        return FakeSDPABackend


class OtherFakeCpuPlatform(FakeCpuPlatform):
    pass


class NotAPlatform:
    pass
'''


@pytest.fixture(autouse=True)
def fresh_platform(monkeypatch):
    """No cached platform, env switch or fake package leaks into or out of a test."""
    monkeypatch.delenv("PAGEDLLM_PLATFORM", raising=False)
    monkeypatch.delenv("PAGEDLLM_DEVICE", raising=False)
    reset_current_platform()
    yield
    reset_current_platform()
    for name in [m for m in sys.modules if m == PKG or m.startswith(PKG + ".")]:
        del sys.modules[name]


def install_plugins(tmp_path: Path, monkeypatch, entries: dict[str, str]) -> None:
    """Put the fake package plus a dist-info registering `entries` (entry-point name -> function
    of the package, or a full "module:attr" reference) on sys.path."""
    pkg = tmp_path / PKG
    pkg.mkdir()
    (pkg / "__init__.py").write_text(textwrap.dedent(_PACKAGE_SOURCE))
    (pkg / "platform.py").write_text(textwrap.dedent(_PLATFORM_SOURCE))
    dist = tmp_path / "pagedllm_fake_platform-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: pagedllm-fake-platform\n"
                                   "Version: 0.1\n")
    lines = [f"{name} = {ref if ':' in ref else f'{PKG}:{ref}'}" for name, ref in entries.items()]
    (dist / "entry_points.txt").write_text("[pagedllm.platform_plugins]\n" + "\n".join(lines)
                                           + "\n")
    monkeypatch.syspath_prepend(str(tmp_path))


def test_available_plugin_is_selected_with_its_backend(tmp_path, monkeypatch):
    install_plugins(tmp_path, monkeypatch, {"a-unavailable": "unavailable",
                                            "cpu-fake": "cpu_fake"})
    platform = get_current_platform()
    assert type(platform).__name__ == "FakeCpuPlatform"
    assert current_platform.attention_backend_name() == "fake_cpu_sdpa"
    assert get_attention_backend().name == "fake_cpu_sdpa"


def test_env_chooses_between_plugins_and_builtins(tmp_path, monkeypatch):
    install_plugins(tmp_path, monkeypatch, {"cpu-fake": "cpu_fake", "cpu-fake-two": "cpu_fake_two"})
    assert type(get_current_platform()).__name__ == "FakeCpuPlatform"   # first by name
    monkeypatch.setenv("PAGEDLLM_PLATFORM", "cpu-fake-two")
    reset_current_platform()
    assert type(get_current_platform()).__name__ == "OtherFakeCpuPlatform"
    monkeypatch.setenv("PAGEDLLM_PLATFORM", "cpu")
    reset_current_platform()
    assert type(get_current_platform()) is CpuPlatform
    assert get_attention_backend().name in ("cpu_paged", "torch_sdpa")


def test_no_plugins_falls_back_to_builtin():
    import torch

    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert current_platform.device_type == expected


@pytest.mark.parametrize("entries, env, match", [
    ({"cpu-fake": "cpu_fake"}, "no-such-plugin", r"no-such-plugin.*names no platform.*cpu-fake"),
    ({"npu-off": "unavailable"}, "npu-off", r"'npu-off'.*not available"),
    ({"broken": "raises"}, None, r"'broken' raised RuntimeError: driver not loaded"),
    ({"broken": "raises", "cpu-fake": "cpu_fake"}, "broken", r"'broken' raised"),
    ({"a-missing": "missing_class"}, None, r"'a-missing'.*NoSuchPlatform.*cannot be imported"),
    ({"odd": "not_a_platform"}, None, r"'odd'.*NotAPlatform.*not a subclass"),
    ({"int": "not_a_string"}, None, r"'int' must return the dotted path.*42"),
    ({"gone": "no_such_module_xyz:plugin"}, None, r"'gone'.*failed to load"),
    ({"cpu": "cpu_fake"}, None, r"'cpu'.*name of a built-in platform"),
])
def test_plugin_errors_name_the_plugin(tmp_path, monkeypatch, entries, env, match):
    install_plugins(tmp_path, monkeypatch, entries)
    if env is not None:
        monkeypatch.setenv("PAGEDLLM_PLATFORM", env)
    with pytest.raises(PlatformPluginError, match=match):
        current_platform.device_type


def test_bad_legacy_device_switch_is_refused(monkeypatch):
    monkeypatch.setenv("PAGEDLLM_DEVICE", "tpu")
    with pytest.raises(ValueError, match="PAGEDLLM_DEVICE"):
        get_current_platform()


def test_generate_under_plugin_platform_matches_cpu(tmp_path, monkeypatch, tiny_llama):
    from pagedllm import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 17, 42, 99, 7]}, {"prompt_token_ids": [3, 8, 250]}]

    def run() -> list[list[int]]:
        llm = LLM(str(tiny_llama), dtype="float32", kv_cache_memory_bytes=2 * 2**20)
        try:
            return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]
        finally:
            del llm

    install_plugins(tmp_path, monkeypatch, {"cpu-fake": "cpu_fake"})
    monkeypatch.setenv("PAGEDLLM_PLATFORM", "cpu")
    monkeypatch.setenv("PAGEDLLM_ATTENTION_BACKEND", "torch_sdpa")
    expected = run()
    monkeypatch.delenv("PAGEDLLM_PLATFORM")
    reset_current_platform()
    fake_tokens = run()
    calls = sys.modules[f"{PKG}.platform"].FORWARD_CALLS
    assert len(calls) > 0, "the plugin platform's attention backend was not used"
    assert fake_tokens == expected
    assert all(len(t) == 8 for t in expected)
