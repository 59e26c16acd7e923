"""Where traces go: a capture into the default temp folder lasts as long as its process (nothing piles up
in the system's temp folder); K3LAB_TRACE_DIR or trace_dir= keep theirs."""

import json
import os
import subprocess
import sys

import pytest

_CAPTURE = """
import json, sys, torch
from k3lab import profile
a = torch.ones(8, 8)
kept = sys.argv[1] if len(sys.argv) > 1 else None
cap = profile.capture(lambda: a @ a, steps=1, device="cpu", trace_dir=kept)
print(json.dumps([str(cap.trace_path), cap.trace_path.exists()]))
"""


def _run(tmp_path, *args, env_extra=None):
    env = {k: v for k, v in os.environ.items() if k != "K3LAB_TRACE_DIR"}
    env.update({"TMPDIR": str(tmp_path / "tmp"), **(env_extra or {})})
    (tmp_path / "tmp").mkdir(exist_ok=True)
    out = subprocess.run([sys.executable, "-c", _CAPTURE, *args], env=env, capture_output=True, text=True,
                         timeout=300, check=False)
    assert out.returncode == 0, out.stderr
    path, existed = json.loads(out.stdout.strip().splitlines()[-1])
    return path, existed


@pytest.mark.parametrize("where", ["default", "K3LAB_TRACE_DIR", "trace_dir"])
def test_a_default_trace_is_removed_at_exit_and_a_chosen_one_kept(tmp_path, where):
    chosen = tmp_path / "kept"
    if where == "default":
        path, existed = _run(tmp_path)
        assert existed and path.startswith(str(tmp_path / "tmp" / "k3lab-traces"))
        assert not os.path.exists(path)  # gone with its process
    else:
        args = [str(chosen)] if where == "trace_dir" else []
        env = {"K3LAB_TRACE_DIR": str(chosen)} if where == "K3LAB_TRACE_DIR" else None
        path, existed = _run(tmp_path, *args, env_extra=env)
        assert existed and path.startswith(str(chosen)) and os.path.exists(path)
    assert not list((tmp_path / "tmp").rglob("*.json"))  # nothing left in the temp folder either way
