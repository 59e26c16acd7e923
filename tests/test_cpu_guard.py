"""The check that a test sending CPU tensors through Triton kernels says so (tests/cpu_guard.py): a test
that launched interpreted kernels on CPU tensors fails unless it is marked for the CPU child, asks for
the GPU, or is marked follows_gpu; and the code it names is searched for that question correctly."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest

import cpu_guard
from cpu_child import hooked_folder, run_pytest

TESTS = Path(__file__).resolve().parent

KERNEL = '''
import pytest, torch
import k3lab  # noqa: F401  (TRITON_INTERPRET=1 where there is no GPU, before triton loads)
import triton
import triton.language as tl
from cpu_child import on_a_cpu


@triton.jit
def _twice(p, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(p + i, tl.load(p + i, mask=i < n) * 2, mask=i < n)


def twice(x):
    _twice[(1,)](x, x.numel(), BLOCK=16)
    return x
'''


def test_an_unmarked_cpu_tensor_launch_fails_and_each_way_out_passes(tmp_path):
    """A temporary test file run with tests/conftest.py's hooks, as CI runs the suite on a CPU: the one
    test that sends CPU tensors through a kernel and says nothing fails, naming the fix; marked for the
    child, following the GPU, marked follows_gpu, or launching nothing, the others pass."""
    hooked_folder(tmp_path)
    (tmp_path / "test_new_file.py").write_text(KERNEL + textwrap.dedent('''
        DEV = "cuda" if torch.cuda.is_available() else "cpu"


        def _on_dev(n):
            return torch.ones(n, device=DEV)


        def test_unmarked():
            assert twice(torch.ones(5)).sum() == 10


        @on_a_cpu
        def test_marked():
            assert twice(torch.ones(5)).sum() == 10


        def test_follows_the_device():
            assert twice(_on_dev(5)).sum() == 10


        @pytest.mark.follows_gpu
        def test_declared():
            assert twice(torch.ones(5)).sum() == 10


        def test_no_kernel():
            assert torch.ones(5).sum() == 5
        '''))
    done = run_pytest(tmp_path, CUDA_VISIBLE_DEVICES="", HIP_VISIBLE_DEVICES="")  # a CPU run, on any machine
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    status = {line.split()[1].split("::")[1]: line.split()[0] for line in out.splitlines()
              if line.startswith(("PASSED ", "FAILED ")) and "::" in line}
    assert status == {"test_unmarked": "FAILED", "test_marked": "PASSED", "test_follows_the_device": "PASSED",
                      "test_declared": "PASSED", "test_no_kernel": "PASSED"}, out
    assert "ran 1 Triton launch(es) in the interpreter on CPU tensors (_twice x1; 1 in its body)" in out, out
    assert "Mark it @on_a_cpu" in out and "follows_gpu" in out, out


def test_launches_in_an_unmarked_tests_fixtures_fail_it_in_setup_and_teardown(tmp_path):
    """A kernel launched on CPU tensors by a fixture, not the test's body, would refuse on a GPU machine
    just the same: a module-scoped fixture's setup fails the first test that takes it, a fixture's
    teardown errors the test in teardown; a fixture that follows the GPU, and a marked test, pass."""
    hooked_folder(tmp_path)
    (tmp_path / "test_fixtures.py").write_text(KERNEL + textwrap.dedent('''
        DEV = "cuda" if torch.cuda.is_available() else "cpu"


        @pytest.fixture(scope="module")
        def built():
            return twice(torch.ones(5))


        @pytest.fixture
        def torn():
            yield 1
            twice(torch.ones(3))


        @pytest.fixture
        def on_dev():
            return twice(torch.ones(5, device=DEV))


        def test_first_to_take_built(built):
            assert built.sum() == 10


        def test_second_to_take_built(built):
            assert built.sum() == 10


        def test_torn(torn):
            assert torn == 1


        def test_on_dev(on_dev):
            assert on_dev.sum() == 10


        @on_a_cpu
        def test_marked_torn(torn):
            assert torn == 1
        '''))
    done = run_pytest(tmp_path, CUDA_VISIBLE_DEVICES="", HIP_VISIBLE_DEVICES="")
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    status = {}
    for line in out.splitlines():
        if line.startswith(("PASSED ", "FAILED ", "ERROR ")) and "::" in line:
            status.setdefault(line.split()[1].split("::")[1], []).append(line.split()[0])
    assert status == {"test_first_to_take_built": ["FAILED"], "test_second_to_take_built": ["PASSED"],
                      "test_torn": ["PASSED", "ERROR"], "test_on_dev": ["PASSED"],
                      "test_marked_torn": ["PASSED"]}, out
    assert "(_twice x1; 1 in its fixtures' setup)" in out, out
    assert "(_twice x1; 1 in its fixtures' teardown)" in out, out


def test_this_run_counts_interpreted_launches():
    """The suite's own runs carry the check: where kernels are interpreted the launch counter is in."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton kernels run compiled in this process: the check counts interpreted launches only")
    from triton.runtime import interpreter

    assert getattr(interpreter.GridExecutor.__call__, "_k3lab_counted", False)


HELPER = '''
import torch
HELPER_DEV = "cuda" if torch.cuda.is_available() else "cpu"


def make(n):
    return torch.ones(n, device=HELPER_DEV)


def plain(n):
    return torch.ones(n)
'''

MODULE = '''
import pytest, torch
import guard_helper as gh
from guard_helper import make, plain
from k3lab import env

DEV = "cuda" if torch.cuda.is_available() else "cpu"
GPU = torch.cuda.is_available()
CASES = [torch.ones(2, device=DEV)]
PLAIN = [torch.ones(2)]


def _build(n):
    return torch.zeros(n, device=DEV)


def _indirect(n):
    return _build(n) + 1


@pytest.fixture
def dev_tensor():
    return torch.ones(3, device=DEV)


@pytest.fixture
def cpu_tensor():
    return torch.ones(3)


def test_direct():
    x = torch.ones(3, device=DEV)


def test_through_two_helpers():
    _indirect(3)


def test_fixture(dev_tensor):
    pass


def test_plain_fixture(cpu_tensor):
    pass


@pytest.mark.parametrize("x", CASES)
def test_parametrized(x):
    pass


@pytest.mark.parametrize("x", PLAIN)
def test_plain_parametrized(x):
    pass


@pytest.mark.skipif(GPU, reason="CPU only")
def test_skipped_on_gpu():
    torch.ones(3)


def test_helper_module_function():
    make(3)


def test_helper_module_attribute():
    gh.make(3)


def test_helper_without_device():
    plain(3)


def test_asks_env():
    env.detect()


def test_cpu_only():
    x = torch.ones(3)
    y = x * 2


class TestGrouped:
    WHERE = DEV

    def test_method(self):
        pass


class TestPlain:
    def test_method(self):
        torch.ones(3)

    def other(self):
        return DEV
'''


@pytest.mark.parametrize("name, cls, fixtures, asks", [
    ("test_direct", None, (), True),
    ("test_through_two_helpers", None, (), True),
    ("test_fixture", None, ("dev_tensor",), True),
    ("test_plain_fixture", None, ("cpu_tensor",), False),
    ("test_parametrized", None, (), True),
    ("test_plain_parametrized", None, (), False),
    ("test_skipped_on_gpu", None, (), True),
    ("test_helper_module_function", None, (), True),
    ("test_helper_module_attribute", None, (), True),
    ("test_helper_without_device", None, (), False),
    ("test_asks_env", None, (), True),
    ("test_cpu_only", None, (), False),
    ("test_method", "TestGrouped", (), True),
    ("test_method", "TestPlain", (), False),  # another method's question is not this one's
])
def test_asks_for_gpu_follows_the_names_a_test_uses(tmp_path, name, cls, fixtures, asks):
    (tmp_path / "guard_helper.py").write_text(HELPER)
    (tmp_path / "test_guarded.py").write_text(MODULE)
    cpu_guard.source.cache_clear()
    assert cpu_guard.asks_for_gpu(tmp_path / "test_guarded.py", name, cls, fixtures) is asks


def test_the_mla_glue_file_is_seen_as_cpu_only():
    """The file behind the H100's 51 failures: its kernel tests ask nothing about the GPU (so they need
    the mark they carry), while a DEV-following kernel file asks in every test that launches."""
    assert not cpu_guard.asks_for_gpu(TESTS / "test_mla_glue.py", "test_out_gate_rounds_as_the_reference")
    dcp_test = "test_two_shards_by_hand_equal_attention_over_both"
    assert cpu_guard.asks_for_gpu(TESTS / "test_dcp_merge.py", dcp_test)
