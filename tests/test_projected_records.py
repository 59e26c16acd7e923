"""Projected and modelled records live apart from measured ones (k3lab.studies.serving's docstring): no
record under a measured device's folder says it is projected or modelled, the committed curves (MI355X
projected, the H200 given 288 GB modelled) load from profiles/projected/ with their labels, and save_records
files a new one there."""

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
# words that label a record as the model's output: a device naming them, or an extra label opening with one
# ('projected', 'modelled from H200 step records')
MODEL_WORDS = ("projected", "modelled")
MODELLED_CASE = "curve.h200."  # the H200 curve the study once filed in the H200's folder


def projected_why(d: dict) -> str | None:
    """Why a record (a dict) says it is projected or modelled: a projection key in extra, a device or an
    extra label naming it; None when it says nothing of the kind."""
    extra = d.get("extra") if isinstance(d.get("extra"), dict) else {}
    keys = [k for k in PROJECTION_KEYS if k in extra]
    if keys:
        return f"extra has {keys}"
    if any(w in str(d.get("device", "")).lower() for w in MODEL_WORDS):
        return f"device {d.get('device')!r}"
    labels = [k for k, v in extra.items()
              if isinstance(v, str) and v.strip().lower().split(" ")[0] in MODEL_WORDS]
    return f"extra {labels} says {[extra[k] for k in labels]}" if labels else None


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


def test_the_check_fails_on_a_modelled_record_in_a_measured_folder(tmp_path):
    """The modelled H200 curve placed back under the H200's serving folder as the study once filed it
    (device 'NVIDIA H200', only extra.measured_or_modelled saying modelled), and a measured record given
    that label: the check names each; the measured records beside them pass."""
    root = tmp_path / "profiles"
    folder = root / "nvidia-h200" / "serving"
    folder.mkdir(parents=True)
    grid = sorted((PROFILES / "nvidia-h200" / "serving").glob("grid.*.json"))[0]
    shutil.copy(grid, folder / grid.name)
    assert projected_in_measured_folders(root) == []
    moved = sorted((PROFILES / PROJECTED).rglob(f"{MODELLED_CASE}*.json"))[0]
    old = json.loads(moved.read_text())
    for d in old:
        d["device"] = serving.SOURCE_DEVICE
        for k in PROJECTION_KEYS:
            d["extra"].pop(k, None)
    (folder / moved.name).write_text(json.dumps(old))
    found = projected_in_measured_folders(root)
    assert len(found) == 1 and moved.name in found[0] and "modelled from H200" in found[0], found
    labelled = json.loads(grid.read_text())
    for d in labelled:
        d["extra"]["measured_or_modelled"] = "Modelled"
    (folder / grid.name).write_text(json.dumps(labelled))
    assert sorted(f.split(":")[0] for f in projected_in_measured_folders(root)) == sorted(
        str(p.relative_to(root)) for p in (folder / grid.name, folder / moved.name))


@pytest.mark.parametrize("key, device, label", [
    ("mi355x", "AMD Instinct MI355X (projected from NVIDIA H200 records)", "projected"),
    ("h200", "NVIDIA H200 with 288 GB (modelled from NVIDIA H200 records)",
     "modelled from H200 step records"),
])
def test_each_curve_loads_from_its_own_folder_with_its_labels(key, device, label):
    recs = serving.projected_records(key)
    assert len(recs) >= 100, len(recs)  # the committed front points of every rung
    assert serving.curve_device(key) == device
    folder = PROFILES / PROJECTED / bench.device_slug(device, "cuda") / serving.NAME
    assert len(list(folder.glob("*.json"))) == len(recs)
    for r in recs:
        assert r.case.startswith(f"curve.{key}.") and r.device == device and r.mode == "model"
        assert r.extra["projected"] is True and r.extra["measured_or_modelled"] == label
        src = r.extra["projected_from"]
        assert src["device"] == serving.SOURCE_DEVICE
        assert "profiles/nvidia-h200/decode_step/" in src["records"]["steps"]
        assert r.extra["tokens_per_s_gpu"] > 0 and r.extra["tokens_per_s_user"] > 0
    if key == "h200":  # the H200's curve assumes 288 GB per GPU, not the H200's own 141 GB
        assert {r.extra["memory_gb"] for r in recs} == {serving.H200_MEMORY_GB}
        assert {r.extra["gpu"] for r in recs} == {serving.SOURCE_DEVICE}
    # no reader of the H200's records, or of every device's, meets them
    for read in (bench.load_records(serving.NAME, device="nvidia-h200"), bench.load_records(serving.NAME)):
        assert read and not [r.case for r in read if r.case.startswith("curve.")]


def test_curve_device_names_what_the_curve_is():
    assert serving.modelled_device("NVIDIA H200", 288.0) == (
        "NVIDIA H200 with 288 GB (modelled from NVIDIA H200 records)")
    for bad in ("", None, 3):
        with pytest.raises(ValueError, match="gpu_name"):
            serving.modelled_device(bad, 288.0)
    for bad in (0, -1.0, "288", True, None):
        with pytest.raises(ValueError, match="memory_gb"):
            serving.modelled_device("NVIDIA H200", bad)


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


def test_the_study_labels_each_curve_and_files_it_apart(tmp_path):
    """curve_records: MI355X's records carry the projected device, the H200's the modelled one, both the
    extras that make save_records file them under profiles/projected/, never in the H200's folder."""
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
    assert all(r.device == serving.curve_device("h200") and r.extra["projected"] is True
               and r.extra["measured_or_modelled"] == "modelled from H200 step records"
               and r.extra["memory_gb"] == serving.H200_MEMORY_GB
               and r.extra["projected_from"]["device"] == serving.SOURCE_DEVICE for r in h2)
    root = tmp_path / "profiles"
    bench.save_records(mi[:2] + h2[:2], root=root)
    assert [p.name for p in root.iterdir()] == [PROJECTED] and projected_in_measured_folders(root) == []
    back = serving.projected_records("h200", root=root)
    assert sorted(r.case for r in back) == sorted(r.case for r in h2[:2])


def test_the_records_trend_leaves_projections_out():
    """`k3lab records trend serving` reads git history too, where the projected and the modelled curves were
    once filed under the H200's folder with the H200 as device: none of those versions is a row of the
    H200's trend."""
    from k3lab.profiling import trend

    h = trend.history(serving.NAME, device="nvidia-h200")
    assert not h.empty and (h["case"].str.startswith("validate.")).any()
    assert not h["case"].str.startswith("curve.").any()  # neither projected nor modelled curves
    assert set(h["device"]) == {serving.SOURCE_DEVICE}
