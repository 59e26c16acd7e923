"""Projected records live apart from measured ones (k3lab.studies.serving's docstring): no record under a
measured device's folder says it is projected, the committed projections load from profiles/projected/ with
their labels, and save_records files a new projection there."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from k3lab import bench
from k3lab.bench.records import PROJECTED
from k3lab.studies import serving

PROFILES = Path(bench.PROFILES)
NOT_DEVICES = {PROJECTED, "isa", "cpu"}  # folders under profiles/ that hold no measured GPU's records
PROJECTION_KEYS = ("projected", "projection", "projected_from")


def projected_why(d: dict) -> str | None:
    """Why a record (a dict) says it is projected: a projection key in extra, a device or an extra label
    naming it; None when it says nothing of the kind."""
    extra = d.get("extra") if isinstance(d.get("extra"), dict) else {}
    keys = [k for k in PROJECTION_KEYS if k in extra]
    if keys:
        return f"extra has {keys}"
    if "projected" in str(d.get("device", "")).lower():
        return f"device {d.get('device')!r}"
    labels = [k for k, v in extra.items() if isinstance(v, str) and v.strip().lower() == "projected"]
    return f"extra {labels} says 'projected'" if labels else None


def projected_in_measured_folders(profiles: Path) -> list[str]:
    """One line per record under a measured device's folder (profiles/<slug>/ other than NOT_DEVICES) that
    says it is projected."""
    out = []
    for dev in sorted(p for p in profiles.iterdir() if p.is_dir() and p.name not in NOT_DEVICES):
        for f in sorted(dev.rglob("*.json")):
            try:
                data = json.loads(f.read_text())
            except (ValueError, UnicodeDecodeError):
                continue
            for d in data if isinstance(data, list) else [data]:
                why = projected_why(d) if isinstance(d, dict) else None
                if why:
                    out.append(f"{f.relative_to(profiles)}: {why}")
    return out


def test_no_record_under_a_measured_device_folder_says_it_is_projected():
    devices = [p.name for p in PROFILES.iterdir() if p.is_dir() and p.name not in NOT_DEVICES]
    assert "nvidia-h200" in devices, devices  # the check reads the folder that held the projections
    assert projected_in_measured_folders(PROFILES) == []


def test_the_check_fails_on_the_old_layout(tmp_path):
    """A projected record placed back under the H200's serving folder, as the study once filed it, with the
    H200 as its device and only extra.measured_or_modelled saying projected: the check names it."""
    root = tmp_path / "profiles"
    shutil.copytree(PROFILES / "nvidia-h200" / "serving", root / "nvidia-h200" / "serving")
    assert projected_in_measured_folders(root) == []  # the measured folder's own records pass
    moved = sorted((PROFILES / PROJECTED).rglob("curve.mi355x.*.json"))[0]
    old = json.loads(moved.read_text())
    for d in old:
        d["device"] = serving.SOURCE_DEVICE
        for k in PROJECTION_KEYS:
            d["extra"].pop(k, None)
    (root / "nvidia-h200" / "serving" / moved.name).write_text(json.dumps(old))
    found = projected_in_measured_folders(root)
    assert len(found) == 1 and moved.name in found[0] and "measured_or_modelled" in found[0], found
    # the moved file placed back unchanged is named for its device and its extra keys
    shutil.copy(moved, root / "nvidia-h200" / "serving" / moved.name)
    found = projected_in_measured_folders(root)
    assert len(found) == 1 and "extra has ['projected', 'projected_from']" in found[0], found


def test_the_projected_curve_loads_from_its_own_folder_with_its_labels():
    recs = serving.projected_records("mi355x")
    assert len(recs) >= 100, len(recs)  # the committed front points of every rung
    device = serving.projected_device("AMD Instinct MI355X")
    assert device == "AMD Instinct MI355X (projected from NVIDIA H200 records)"
    folder = PROFILES / PROJECTED / bench.device_slug(device, "cuda") / serving.NAME
    assert len(list(folder.glob("curve.mi355x.*.json"))) == len(recs)
    for r in recs:
        assert r.case.startswith("curve.mi355x.") and r.device == device and r.mode == "model"
        assert r.extra["projected"] is True and r.extra["measured_or_modelled"] == "projected"
        src = r.extra["projected_from"]
        assert src["device"] == serving.SOURCE_DEVICE
        assert "profiles/nvidia-h200/decode_step/" in src["records"]["steps"]
        assert r.extra["tokens_per_s_gpu"] > 0 and r.extra["tokens_per_s_user"] > 0
    # no reader of the H200's records, or of every device's, meets them
    for read in (bench.load_records(serving.NAME, device="nvidia-h200"), bench.load_records(serving.NAME)):
        assert read and not [r.case for r in read if r.case.startswith("curve.mi355x.")]
    with pytest.raises(ValueError, match="modelled, not projected"):
        serving.projected_records("h200")


def _record(**kw) -> bench.Record:
    base = dict(study=serving.NAME, case="curve.mi355x.r0.dcp1_k0_c4", variant="before",
                device=serving.projected_device("AMD Instinct MI355X"), backend="cuda", versions={},
                commit="unknown", date="2026-01-01T00:00:00+00:00", shape={"concurrency": 4},
                dtype="bfloat16", median_us=10.0, p20_us=10.0, p80_us=10.0, mode="model",
                extra={"projected": True, "projected_from": {"device": serving.SOURCE_DEVICE}})
    base.update(kw)
    return bench.Record(**base)


def test_save_records_files_a_projection_under_projected_and_reading_devices_passes_it_over(tmp_path):
    root = tmp_path / "profiles"
    measured = _record(case="validate.all_on.b1_4096", device=serving.SOURCE_DEVICE, extra={})
    paths = bench.save_records([_record(), measured], root=root)
    rel = sorted(p.relative_to(root).parts[:2] for p in paths)
    assert rel == [("nvidia-h200", "serving"),
                   (PROJECTED, "amd-instinct-mi355x-projected-from-nvidia-h200-records")], rel
    assert [r.case for r in bench.load_records(root=root)] == [measured.case]
    assert [r.case for r in serving.projected_records("mi355x", root=root)] == [_record().case]
    assert projected_in_measured_folders(root) == []


def test_the_study_labels_a_projected_curve_and_not_the_h200_curve():
    """curve_records on a small workload: MI355X's records carry the projected device and extras (so
    save_records files them apart), the H200's keep the measured device's name and none of them."""
    from k3lab.serving import curve, inputs

    if not bench.load_records("decode_step", device="nvidia-h200"):
        pytest.skip("no committed H200 decode_step records to fit the model to")
    inp = inputs.node_inputs()
    work = curve.agent_workload()
    err = {"kind": "test", "worst": 0.0}
    mi = serving.curve_records("mi355x", inp, work, err)
    h2 = serving.curve_records("h200", inp, work, err)
    assert mi and h2
    assert all(r.device == serving.projected_device("AMD Instinct MI355X") and r.extra["projected"] is True
               and r.extra["projected_from"]["device"] == serving.SOURCE_DEVICE for r in mi)
    assert all(r.device == serving.SOURCE_DEVICE and projected_why(r.to_dict()) is None for r in h2)


def test_the_records_trend_leaves_projections_out():
    """`k3lab records trend serving` reads git history too, where the projected curve was once filed under
    the H200's folder with the H200 as device: none of those versions is a row of the H200's trend."""
    from k3lab.profiling import trend

    h = trend.history(serving.NAME, device="nvidia-h200")
    assert not h.empty and (h["case"].str.startswith("validate.")).any()
    assert not h["case"].str.startswith("curve.mi355x").any()
    assert set(h["device"]) == {serving.SOURCE_DEVICE}
