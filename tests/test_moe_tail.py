"""The latent MoE under TP on gloo ranks: both tails against the single-rank layer, the all-reduce
count, the sharded tail's bytes, the memory formula, and bad input refused before a collective hangs.

The ranks hold CPU tensors, so every spawn names gloo (the default on a machine with a GPU per rank is
NCCL). Time limits leave room for a loaded machine: they only bound a hang, which is still named.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import k3lab  # noqa: F401  (sets TRITON_INTERPRET=1 without a GPU)
from k3lab.bench import check
from k3lab.config import GiB, K3Config
from k3lab.model import init_weights
from k3lab.nn.moe import LatentMoE
from k3lab.parallel import RankError, spawn
from k3lab.parallel import moe_tail as mt

TINY = K3Config.tiny()
ROOM_S = 180  # a small gloo job's limit here
ROOT = Path(__file__).resolve().parents[1]


def _layer(dtype=torch.float32):
    return init_weights(LatentMoE(TINY), seed=5).to(dtype)


def _x(n=6, dtype=torch.float32, seed=9):
    return torch.randn(n, TINY.hidden_size, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _tails_on_rank(rank, world_size, dtype, backends):
    """Each tail on this rank: output, all_reduce calls counted by wrapping torch's own function,
    other collectives, and the bytes of up_proj's storage."""
    layer, x = _layer(dtype), _x(dtype=dtype)
    calls = {"all_reduce": 0, "all_gather": 0}
    real = {name: getattr(dist, name) for name in calls}

    def counted(name):
        def fn(*a, **k):
            calls[name] += 1
            return real[name](*a, **k)
        return fn

    out = {}
    with torch.no_grad():
        for tail in mt.TAILS:
            for verify in (True, False):
                w = mt.shard_moe(layer, world_size, rank, tail)
                for name in calls:
                    calls[name] = 0
                    setattr(dist, name, counted(name))
                try:
                    y = mt.TPLatentMoE(w, experts_backend=backends, tail_backend=backends, verify=verify)(x)
                finally:
                    for name, fn in real.items():
                        setattr(dist, name, fn)
                out[tail, verify] = (y, dict(calls), w.up_proj.untyped_storage().nbytes())
    return out


@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
def test_both_tails_equal_the_single_rank_layer_with_two_all_reduces(world_size):
    with torch.no_grad():
        ref = _layer()(_x().unsqueeze(0))[0]
    res = spawn(_tails_on_rank, world_size, torch.float32, None, backend="gloo", timeout_s=ROOM_S)
    for (tail, verify), (y, calls, up_bytes) in res.items():
        check(y, ref, dtype=torch.float32, max_rel=1e-5, name=f"{tail} at world size {world_size}")
        assert calls == {"all_reduce": 2, "all_gather": int(verify)}, (tail, verify, calls)
        assert up_bytes == mt.tail_bytes(TINY, world_size, tail, torch.float32) // TINY.num_moe_layers


def test_tails_in_bf16():
    """Two ranks, the torch path in bf16 against the bf16 single-rank layer."""
    with torch.no_grad():
        ref = _layer(torch.bfloat16)(_x(dtype=torch.bfloat16).unsqueeze(0))[0]
    res = spawn(_tails_on_rank, 2, torch.bfloat16, "torch", backend="gloo", timeout_s=ROOM_S)
    for (tail, _), (y, calls, _) in res.items():
        check(y, ref, dtype=torch.bfloat16, name=f"{tail} torch bf16")
        assert calls["all_reduce"] == 2


@pytest.mark.slow
def test_tails_with_the_triton_kernels_in_the_interpreter():
    """Two gloo ranks run the grouped expert kernels and the Triton-norm tail on CPU tensors, in fp32,
    against the single-rank layer. Gloo ranks hold CPU tensors, where the kernels run only in Triton's
    interpreter, which is chosen when triton is imported: so the check runs in a fresh process with
    TRITON_INTERPRET=1 and no GPU visible, the same on a CPU machine and on a GPU machine."""
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="", HIP_VISIBLE_DEVICES="",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    cmd = [sys.executable, "-m", "k3lab.parallel.check", "moe", "--world-size", "2", "--backend", "gloo",
           "--tokens", "6", "--experts-backend", "triton", "--tail-backend", "triton",
           "--timeout-s", str(ROOM_S)]
    run = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=ROOM_S + 120)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    assert "moe tail check: 2 ranks" in out and "OK: both tails equal the single-rank layer" in out
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["replicated"], ["sharded"])]
    assert len(rows) == 4 and all(r[4] == "2" for r in rows), out  # 2 tails x 2 ranks, two all-reduces each


def test_the_moe_check_refuses_an_unknown_backend_by_name(capsys):
    from k3lab.parallel import check as pcheck

    assert pcheck.main(["moe", "--world-size", "2", "--experts-backend", "cuda"]) == 2
    err = capsys.readouterr().err
    assert "experts_backend must be one of" in err and "'torch'" in err and "'triton'" in err, err
    assert "got 'cuda'" in err, err


def test_sharded_rows_are_copies_not_views_of_the_whole_weight():
    layer = _layer()
    w = mt.shard_moe(layer, 4, 3, "sharded")
    rows = TINY.hidden_size // 4
    assert w.own_cols == (3 * rows, 4 * rows)
    assert w.up_proj.untyped_storage().nbytes() == rows * TINY.routed_expert_hidden_size * 4
    torch.testing.assert_close(w.up_proj, layer.routed_expert_up_proj.weight[3 * rows:])
    assert w.nbytes()["up_proj"] * 4 == mt.shard_moe(layer, 4, 3, "replicated").nbytes()["up_proj"]


def test_freed_memory_at_k3_tp8():
    full = K3Config.full()
    freed = mt.freed_bytes(full, 8, torch.bfloat16)
    assert freed == 92 * 7168 * 3584 * 2 * 7 // 8 == 4_136_108_032
    assert round(freed / GiB, 2) == 3.85
    assert mt.tail_bytes(full, 8, "sharded", "bf16") * 8 == mt.tail_bytes(full, 8, "replicated", "bf16")
    assert mt.cache_positions(full, freed) == freed // 13_824  # 24 MLA layers x 576 B in FP8
    cost = mt.tail_cost(full, 8, "sharded", 64, "bf16")
    assert cost["rows"] == 896 and cost["weight_bytes"] == 896 * 3584 * 2 + 3584 * 2
    assert cost["flops"] == 2 * 64 * 896 * 3584 + 4 * 64 * 3584


def test_world_size_that_does_not_divide_is_refused_by_name():
    meta_full = LatentMoE(K3Config.full(), device="meta")  # K3's shapes, no memory
    with pytest.raises(ValueError, match="does not divide the hidden size .* 7168"):
        mt.shard_moe(meta_full, 3, 0, "sharded")
    odd = LatentMoE(K3Config(**{**TINY.__dict__, "moe_intermediate_size": 72, "name": "odd"}), device="meta")
    with pytest.raises(ValueError, match="does not divide the expert intermediate size 72"):
        mt.shard_moe(odd, 16, 0, "replicated")
    with pytest.raises(ValueError, match="tail must be one of"):
        mt.shard_moe(meta_full, 8, 0, "columns")
    with pytest.raises(ValueError, match=r"rank must be an integer in \[0, world_size=8\)"):
        mt.shard_moe(meta_full, 8, 8, "sharded")
    with pytest.raises(ValueError, match="does not divide the hidden size"):
        mt.run_check(3)


def test_single_rank_without_a_process_group_and_bad_x():
    layer = _layer()
    moe = mt.TPLatentMoE(mt.shard_moe(layer, 1, 0, "sharded"))
    with torch.no_grad():
        check(moe(_x()), layer(_x().unsqueeze(0))[0], dtype=torch.float32, max_rel=1e-5)
    with pytest.raises(ValueError, match=r"x must be a \[N, 256\] tensor"):
        moe(_x()[:, :100])
    with pytest.raises(ValueError, match="x must be torch.float32"):
        moe(_x().double())
    with pytest.raises(ValueError, match="torch.distributed is not initialized"):
        mt.TPLatentMoE(mt.shard_moe(layer, 2, 0, "sharded"))(_x())


def _differing_x(rank, world_size, what):
    layer = _layer()
    x = _x(n=6 if (what != "tokens" or rank == 0) else 5)
    if what == "values" and rank == 1:
        x[2, 7] += 1e-3
    with torch.no_grad():
        return mt.TPLatentMoE(mt.shard_moe(layer, world_size, rank, "sharded"))(x)


@pytest.mark.parametrize("what, message", [("values", "differs from rank 0 in x"),
                                           ("tokens", "differs from rank 0 in token count")])
def test_x_that_differs_across_ranks_is_refused_before_the_all_reduces(what, message):
    with pytest.raises(RankError, match=message) as info:
        spawn(_differing_x, 2, what, backend="gloo", timeout_s=ROOM_S)
    assert info.value.exc_type == "ValueError"


def test_run_check_passes_and_prints_the_counts(capsys):
    assert mt.run_check(2, tokens=4) == 0
    text = capsys.readouterr().out
    assert "OK" in text and text.count(" 2 ") >= 4
    with pytest.raises(ValueError, match="unknown option"):
        mt.run_check(2, token=4)
