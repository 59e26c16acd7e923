"""The optimization map (k3lab.optimizations) against the tree, the README and the report."""

from __future__ import annotations

import dataclasses
import shutil

import pytest

from k3lab import optimizations as opt
from k3lab.report import front


def test_the_map_agrees_with_the_tree():
    assert opt.problems() == []


def test_problems_name_renamed_files_unknown_names_and_orphans():
    scan = opt.by_name("kda_scan")
    broken = dataclasses.replace(
        scan, notebooks=("99_*.ipynb",), studies=("kda_chunk",), switches=("kda_scan",),
        ops=("k3lab.ops.kda_scan",),
        kernels=("kernels/kda_scan.cu", "k3lab.ops.kda_chunk.scan._no_kernel",
                 "k3lab.ops.kda_chunk.scan_math"),
        docs=("docs/kda_chunk.md",), records=("profiles/nvidia-h200/kda_chunk",))
    entries = tuple(broken if e is scan else e for e in opt.ENTRIES if e.name != "draft_depth")
    found = "\n".join(opt.problems(entries))
    for expected in (
            "notebook glob '99_*.ipynb' finds nothing", "study 'kda_chunk' is not a key",
            "switch 'kda_scan' is not a key", "module 'k3lab.ops.kda_scan' does not import",
            "kernel 'kernels/kda_scan.cu' is not a file",
            "kernel 'k3lab.ops.kda_chunk.scan._no_kernel' does not resolve",
            "'k3lab.ops.kda_chunk.scan_math' is a module, not a Triton kernel",
            "doc 'docs/kda_chunk.md' is not a file", "records folder 'profiles/nvidia-h200/kda_chunk' is not",
            # what the broken and the missing entries leave unclaimed
            "notebook 05_kda_scan.ipynb is in no entry", "notebook 06_draft_depth.ipynb is in no entry",
            "study 'draft_depth' is in no entry", "study 'kda_precision' is in no entry",
            "switch 'kda_verify_tiles' is in no entry", "op module k3lab.ops.kda_chunk is in no entry",
            "kernels/kda_chunk_walk.cu is in no entry",
            "Triton kernel k3lab.ops.kda_chunk.walk._walk_kernel is in no entry",
            "docs/draft_depth.md is in no entry", "profiles/nvidia-h200/kda_verify is in no entry"):
        assert expected in found, expected


def test_a_new_file_of_the_tree_in_no_entry_is_named(tmp_path):
    for folder in ("notebooks", "docs", "profiles"):
        (tmp_path / folder).symlink_to(opt.REPO / folder)
    (tmp_path / "k3lab").mkdir()
    (tmp_path / "k3lab" / "ops").symlink_to(opt.REPO / "k3lab" / "ops")
    shutil.copytree(opt.REPO / "kernels", tmp_path / "kernels")
    assert opt.problems(root=tmp_path) == []
    (tmp_path / "kernels" / "kda_fast.cu").write_text("// a new kernel\n")
    assert opt.problems(root=tmp_path) == ["kernels/kda_fast.cu is in no entry and not infrastructure"]


def test_records_folders_are_the_entrys_own_studies():
    for e in opt.ENTRIES:
        for r in e.records:
            assert r.startswith(f"profiles/{opt.RECORDS_DEVICE}/"), (e.name, r)
            assert r.rsplit("/", 1)[1] in e.studies, (e.name, r)
    mla = opt.by_name("mla_padding")
    moved = dataclasses.replace(mla, records=("profiles/nvidia-h200/kda_scan",))
    assert any("is not one of the entry's studies" in p for p in opt.problems((moved,)))


def test_readme_notebook_table_is_the_maps():
    readme = (opt.REPO / "README.md").read_text()
    table = opt.readme_section_table(readme)
    assert table == opt.readme_table(), "regenerate it: python -m k3lab.optimizations --markdown"
    assert len(table.splitlines()) == 2 + len(opt.ENTRIES)
    assert "| `04_mla_padding` (+ `04b`) | MLA head padding (4) |" in table
    # a tree without the notebooks renders the globs, so a missing lesson shows in the diff
    assert "| `04_*.ipynb` `04b_*.ipynb` |" in opt.readme_table(root=opt.REPO / "docs")


def test_the_command_prints_the_table_and_the_map(capsys):
    assert opt.main(["--markdown"]) == 0
    assert capsys.readouterr().out == opt.readme_table()
    assert opt.main([]) == 0
    out = capsys.readouterr().out
    assert "kda_scan: KDA chunk scan" in out
    assert "kernels/kda_chunk_prologue.cu, kernels/kda_chunk_walk.cu" in out
    with pytest.raises(KeyError, match="no optimization 'kda_chunk'; known: anatomy, dcp"):
        opt.by_name("kda_chunk")


def test_the_report_front_reads_the_map():
    assert [o.title for o in front.OPTIMIZATIONS] == [e.title for e in opt.OPTIMIZATIONS]
    for o, e in zip(front.OPTIMIZATIONS, opt.OPTIMIZATIONS):
        assert (o.does, o.notebook, o.studies) == (e.does, e.notebooks[0], e.studies), e.name
        assert {h.study for h in o.headlines} <= set(e.studies), e.name
    names = {e.name for e in opt.OPTIMIZATIONS}
    assert set(front.HEADLINES) <= names and set(front.NOTES) <= names
