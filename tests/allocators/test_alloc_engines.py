"""Which implementation of an allocator model runs (kvguard.allocators.native), and that the choice changes
nothing a user sees: the same `plan --search` and `simulate` answers from the C engines and the Python models.

The engines themselves are held equal to the models op by op in tests/allocators/test_alloc_native_*.py; here, whole
commands. ./dev.sh test refuses to run the suite where the engines did not build, so the C side is exercised.
"""

import json
import os

import pytest
from click.testing import CliRunner
from conftest import EXAMPLES

from kvguard.allocators import native
from kvguard.allocators.device import Device
from kvguard.allocators.mindspore_pool import DynamicMemPool
from kvguard.allocators.torch_alloc import CachingAllocator
from kvguard.cli import main

QWEN = os.path.join(EXAMPLES, "qwen2.5-7b-instruct")


def test_the_c_engines_are_chosen_where_built_and_python_on_request(monkeypatch):
    monkeypatch.delenv(native.ENV, raising=False)
    torch_model = native.caching_allocator(Device(1 << 36), variant="torch_npu")
    pool = native.mindspore_pool(Device(1 << 36), enable_vmm=True)
    assert (native.engine(torch_model), native.engine(pool)) == ("c", "c")
    assert not isinstance(torch_model, CachingAllocator) and not isinstance(pool, DynamicMemPool)
    monkeypatch.setenv(native.ENV, "python")
    assert type(native.caching_allocator(Device(1 << 36))) is CachingAllocator
    assert type(native.mindspore_pool(Device(1 << 36))) is DynamicMemPool
    monkeypatch.setenv(native.ENV, "fast")
    with pytest.raises(ValueError, match="KVGUARD_ALLOCATOR_ENGINE='fast'"):
        native.caching_allocator(Device(1 << 36))


def test_a_configuration_the_engine_does_not_take_runs_on_the_model(monkeypatch):
    monkeypatch.delenv(native.ENV, raising=False)
    # A device of 2**62 bytes or more is past the engines' 64-bit books (torch_native / mindspore_native).
    assert native.engine(native.caching_allocator(Device(1 << 63))) == "python"
    assert native.engine(native.mindspore_pool(Device(1 << 63))) == "python"


def invoke(monkeypatch, engine, *args):
    monkeypatch.setenv(native.ENV, engine)
    result = CliRunner().invoke(main, list(args))
    assert result.exit_code in (0, 1), result.output
    return json.loads(result.output)


@pytest.mark.parametrize("allocator", ["torch", "torch_npu", "mindspore"])
def test_simulate_answers_the_same_from_either_engine(monkeypatch, allocator):
    args = (
        "simulate",
        "--json",
        "--model-config",
        QWEN,
        "--allocator",
        allocator,
        "--total-memory",
        "24GiB",
        "--requests",
        "24",
        "--long-fraction",
        "0.5",
    )
    c, python = invoke(monkeypatch, "auto", *args), invoke(monkeypatch, "python", *args)
    assert (c.pop("allocator_engine"), python.pop("allocator_engine")) == ("c", "python")
    assert c == python


def test_plan_search_answers_the_same_from_either_engine(monkeypatch):
    args = (
        "plan",
        "--json",
        "--search",
        "--device",
        "910B4",
        "--",
        "vllm-mindspore",
        "serve",
        QWEN,
        "--max-model-len",
        "32768",
    )
    assert invoke(monkeypatch, "auto", *args) == invoke(monkeypatch, "python", *args)
