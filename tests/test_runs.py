"""Facts about runs as data (k3lab.studies.runs): every claimed run has its record under profiles/, every
records folder is claimed, every "not yet run on ..." line in code, docs and notebooks is named by the part
it is about and contradicted by no record, and the README's table is the one the data gives."""

import json
from dataclasses import replace

import pytest

from k3lab.studies import runs


def test_the_data_agrees_with_the_records_and_the_text():
    assert runs.problems() == []


def test_readme_table_is_generated():
    readme = (runs.REPO / "README.md").read_text()
    assert runs.readme_table(readme) == runs.markdown()


def test_every_study_is_a_part():
    from k3lab.studies import PROBES, STUDIES

    assert set(STUDIES) | set(PROBES) <= {r.name for r in runs.RUNS}


def _with(part: runs.Run) -> tuple[runs.Run, ...]:
    return tuple(part if r.name == part.name else r for r in runs.RUNS)


def test_a_claim_without_a_record_fails():
    kda = runs.by_name("kda_scan")
    missing = replace(kda, ran_on={**kda.ran_on, "nvidia-h100-80gb-hbm3": "nvidia-h100-80gb-hbm3/kda_scan"})
    assert any("does not exist" in p for p in runs.problems(_with(missing)))
    # a path that exists but holds another device's records
    wrong = replace(kda, ran_on={"nvidia-h100-80gb-hbm3": "nvidia-h200/kda_scan"})
    assert any("whose records name ['NVIDIA H200']" in p for p in runs.problems(_with(wrong)))


def test_an_unclaimed_records_folder_fails():
    left = tuple(r for r in runs.RUNS if r.name != "dcp")
    assert "profiles/nvidia-h200/dcp is in no part's ran_on" in runs.problems(left)


def test_said_not_run_on_a_gpu_with_a_gpu_record_fails():
    part = runs.by_name("serving_run_capacity")
    contradicted = replace(part, ran_on={"nvidia-h200": "nvidia-h200/serving"})
    assert any("said not to have run on a GPU" in p for p in runs.problems(_with(contradicted)))


def test_an_unnamed_or_absent_statement_fails():
    aiter = runs.by_name("aiter")
    kept = tuple(f for f in aiter.not_run["AMD GPU"] if f != "k3lab/env.py")
    fewer = replace(aiter, not_run={"AMD GPU": kept})
    assert ("k3lab/env.py states a part has not run on AMD GPU, and no part of runs.RUNS names it"
            in runs.problems(_with(fewer)))
    wrong = replace(aiter, not_run={"AMD GPU": (*aiter.not_run["AMD GPU"], "k3lab/config.py")})
    assert any("k3lab/config.py is said to state" in p for p in runs.problems(_with(wrong)))


def test_an_amd_record_contradicts_every_amd_statement(tmp_path):
    (tmp_path / "profiles" / "amd-instinct-mi355x").mkdir(parents=True)
    (tmp_path / "profiles" / "amd-instinct-mi355x" / "r.json").write_text(json.dumps({"device": "MI355X"}))
    for d in ("docs", "k3lab", "notebooks"):
        (tmp_path / d).mkdir()
    (tmp_path / "README.md").write_text("The HIP build is not yet run on AMD hardware by this project.\n")
    part = runs.Run("hip", "the HIP build", {}, {"AMD GPU": ("README.md",)})
    out = runs.problems((part,), root=tmp_path)
    assert any("said not to have run on an AMD GPU" in p for p in out)
    assert any("profiles/amd-instinct-mi355x is a device folder not in runs.DEVICES" in p for p in out)


@pytest.mark.parametrize("text,targets", [
    ("the NCCL / RCCL paths are not yet run on a GPU.", {"several GPUs"}),
    ("Not yet run on AMD\n  hardware by this project", {"AMD GPU"}),
    ("its GPU path is not yet\nrun by this project; not yet run on a GPU", {"GPU"}),
    ("The ncu and nsys paths have not yet been run on a GPU by this project.", {"GPU"}),
    ("Compiled only: no AMD timing, nothing run on AMD hardware.", {"AMD GPU"}),
    ("on sm90 it runs; its gfx950 code is compiled\nonly.", {"AMD GPU"}),
    ("Nothing here has run on AMD\nhardware, and no figure is a timing.", {"AMD GPU"}),
    ("the datasheet line for a GPU nobody here ran on, labelled projected", {"AMD GPU"}),
    ("no GPU record yet", set()),
])
def test_statements_are_read_across_lines_and_by_target(text, targets):
    assert runs.statements(text) == targets


def test_write_readme_refuses_a_file_without_markers(tmp_path):
    path = tmp_path / "README.md"
    path.write_text("# no table here\n")
    with pytest.raises(ValueError, match="markers"):
        runs.write_readme(path)
