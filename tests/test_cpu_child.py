"""The child run that lets interpreter tests pass on a GPU machine: it sees no GPU, runs the named
test, and reports its failure."""

from cpu_child import run_as_on_a_cpu


def test_the_child_sees_no_gpu_and_runs_the_interpreter(tmp_path):
    t = tmp_path / "test_probe.py"
    t.write_text("import os, torch\n\ndef test_probe():\n"
                 "    assert not torch.cuda.is_available()\n"
                 "    assert os.environ['TRITON_INTERPRET'] == '1'\n")
    done = run_as_on_a_cpu(str(t), timeout_s=300)
    assert done.returncode == 0 and "1 passed" in done.stdout, done.stdout + done.stderr


def test_a_failing_test_fails_in_the_child(tmp_path):
    t = tmp_path / "test_bad.py"
    t.write_text("def test_bad():\n    assert 1 == 2\n")
    done = run_as_on_a_cpu(str(t), timeout_s=300)
    assert done.returncode == 1 and "1 failed" in done.stdout, done.stdout + done.stderr
