"""k3lab.studies.peers: one place says whether fla, FlashMLA and AITER run here and why not, and no study
keeps its own copy of those checks."""

import ast
from pathlib import Path

import pytest
import torch

from k3lab.ops.mla_decode import peers as mla_peers
from k3lab.studies import peers

STUDIES = Path(__file__).resolve().parents[1] / "k3lab" / "studies"
PEER_CHECKS = {"fla_available", "fla_status", "flashmla_status", "aiter_status", "_gpu", "on_gpu", "_on_gpu"}


def test_on_gpu_follows_the_detected_backend():
    assert peers.on_gpu() == torch.cuda.is_available()


def test_fla_needs_are_checked_by_name():
    for bad in ((), ("torch.nn",), "fla.ops.kda", (3,)):
        with pytest.raises(ValueError, match="needs"):
            peers.fla_status(bad)


def test_fla_without_a_gpu_is_no_peer_and_says_so(monkeypatch):
    monkeypatch.setattr(peers, "on_gpu", lambda: False)
    ok, why = peers.fla_status(peers.FLA_DECODE)
    assert not ok and "GPU" in why


def test_fla_missing_module_is_named(monkeypatch):
    monkeypatch.setattr(peers, "on_gpu", lambda: True)
    ok, why = peers.fla_status(("fla.no_such_module_here",))
    assert not ok and "fla.no_such_module_here" in why and "no fla peer" in why


def test_flashmla_page_size_is_the_ops_and_a_mismatch_is_named():
    assert peers.FLASHMLA_PAGE_SIZE == mla_peers.FLASHMLA_PAGE_SIZE
    ok, why = peers.flashmla_status(page_size=32)
    assert not ok and "32" in why and str(mla_peers.FLASHMLA_PAGE_SIZE) in why
    assert peers.flashmla_status(peers.FLASHMLA_PAGE_SIZE) == mla_peers.flashmla_status()
    if not torch.cuda.is_available():
        assert "NVIDIA GPU" in peers.flashmla_status()[1]


def test_aiter_status_is_the_ops():
    ok, why = peers.aiter_status()
    assert (ok, why) == mla_peers.aiter_status()
    if getattr(torch.version, "hip", None) is None:
        assert not ok and "ROCm" in why


def test_no_study_keeps_its_own_peer_or_gpu_check():
    """The studies ask peers.py; a second definition of one of its checks in a study module fails here
    (the serving run, owned elsewhere, is left out)."""
    copies = []
    for path in STUDIES.rglob("*.py"):
        rel = path.relative_to(STUDIES).as_posix()
        if rel == "peers.py" or rel.startswith("serving"):
            continue
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and node.name in PEER_CHECKS:
                if rel == "mla_padding/measure.py" and node.name == "flashmla_status":
                    continue  # the study's page size handed to peers.flashmla_status, nothing more
                copies.append(f"{rel}:{node.name}")
    assert copies == []
