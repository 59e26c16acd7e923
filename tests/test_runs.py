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
    part = runs.by_name("profile_tools")  # said in its files not to have run on a GPU
    assert "GPU" in part.not_run
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
    ("Run on an H100 (its records are committed); not yet on the H200, whose rate", {"H200"}),
    ("09 has no GPU timing yet.", {"GPU"}),
    ("Its capacity form has run only on a CPU; its GPU cases are planned", {"GPU"}),
])
def test_statements_are_read_across_lines_and_by_target(text, targets):
    assert runs.statements(text) == targets


def test_write_readme_refuses_a_file_without_markers(tmp_path):
    path = tmp_path / "README.md"
    path.write_text("# no table here\n")
    with pytest.raises(ValueError, match="markers"):
        runs.write_readme(path)


def test_said_not_run_on_a_card_it_ran_on_fails():
    part = runs.by_name("ceilings")
    on_h200 = replace(part, ran_on={**part.ran_on, "nvidia-h200": "nvidia-h200/decode_step"},
                      not_run={"H200": ()})
    assert any("ceilings: said not to have run on the H200, but ran on it" in p
               for p in runs.problems(_with(on_h200)))
    assert not any("said not to have run on the H200" in p
                   for p in runs.problems(_with(replace(part, not_run={"H200": ()}))))


def _tree_with_the_gpu_logs(tmp_path, doc: str):
    """A tree holding the committed GPU report logs, empty notebooks of the real names, and `doc` as
    docs/workshop.md."""
    import shutil

    for log in runs.PROFILES.glob("*/gpu_check/report_*.log"):
        dest = tmp_path / log.relative_to(runs.REPO)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(log, dest)
    (tmp_path / "notebooks").mkdir()
    for nb in (runs.REPO / "notebooks").glob("*.ipynb"):
        (tmp_path / "notebooks" / nb.name).write_text(json.dumps({"cells": []}))
    (tmp_path / "docs").mkdir()
    (tmp_path / "k3lab").mkdir()
    (tmp_path / "README.md").write_text("# k3lab\n")
    (tmp_path / "docs" / "workshop.md").write_text(doc)
    return tmp_path


def test_a_notebook_timing_claim_the_logs_contradict_fails(tmp_path):
    doc = (runs.REPO / "docs" / "workshop.md").read_text()
    root = _tree_with_the_gpu_logs(tmp_path, doc)
    assert not [p for p in runs.problems((), root=root) if "timing" in p]  # the page as committed holds
    planted = doc + "\n03, 05, 05b and 06-09 have no H100 figure. 09 has no GPU timing yet.\n"
    (root / "docs" / "workshop.md").write_text(planted)
    out = runs.problems((), root=root)
    h100 = "profiles/nvidia-h100-80gb-hbm3/gpu_check/report_0ebcf91.log"
    assert f"docs/workshop.md says 09 has no GPU timing, but {h100} timed 09_serving_curve" in out
    assert (f"docs/workshop.md says 03, 05, 05b and 06-09 have no H100 timing, but {h100} timed "
            "05b_kda_deep_dive") in out
    # the same claim about a card that never timed the notebook holds: the H200's run has no 09
    (root / "docs" / "workshop.md").write_text(doc + "\n09 has no H200 figure.\n")
    assert not [p for p in runs.problems((), root=root) if "no H200 timing" in p]
    # and the plain statement is a GPU statement no part names
    assert "docs/workshop.md states a part has not run on GPU, and no part of runs.RUNS names it" in out


def test_notebook_claims_name_the_notebooks_of_the_tree():
    claims = runs.notebook_claims("Here 04b and 01-02 have no GPU timing, and 07 has no H200 figure.")
    assert claims == [("04b and 01-02", "GPU", ["04b_mla_deep_dive", "01_dcp", "02_moe_sharding"]),
                      ("07", "H200", ["07_agent_cache"])]
    assert runs.notebook_claims("no timing yet; 3 cells have no output") == []


def test_the_agendas_status_line_is_a_claim_the_logs_hold():
    from k3lab.workshop import agenda

    gpus = agenda.gpu_timings()
    notebooks = sorted({s.notebook for s in agenda.SEGMENTS})
    line = " ".join(agenda.run_status(notebooks, gpus))
    assert runs.notebook_claims(line) == []  # every notebook has a GPU timing on record
    fewer = [(label, {nb: t for nb, t in g.items() if nb != "09_serving_curve"}) for label, g in gpus]
    line = " ".join(agenda.run_status(notebooks, fewer))
    assert "09 has no GPU timing in any run on record." in line
    assert runs.notebook_claims(line) == [("09", "GPU", ["09_serving_curve"])]
