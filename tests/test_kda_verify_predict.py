"""kda_verify.predict's launch floor comes from the committed launch_overhead record, not a constant."""

import pytest

from k3lab import bench
from k3lab.studies import kda_verify


def test_launch_floor_is_the_committed_empty_kernel_graph_record():
    recs = [r for r in bench.load_records("launch_overhead", device="nvidia-h200")
            if r.case == "empty_kernel" and r.mode == "graph"]
    if not recs:
        pytest.skip("no committed launch_overhead record of an empty kernel in a graph")
    assert kda_verify.launch_floor_us() == recs[0].median_us
    p = kda_verify.predict(1, 4)
    assert p["launch floor us"] == recs[0].median_us
    assert p["floor us (all states)"] == max(p["memory floor us (all states)"], recs[0].median_us)


def test_no_record_means_no_launch_floor_and_an_explicit_one_wins():
    assert kda_verify.launch_floor_us(device="no-such-device") is None
    assert kda_verify.predict(1, 4, launch_us=2.5)["launch floor us"] == 2.5


def test_reference_records_are_found_from_any_directory(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    recs = kda_verify.reference_records()
    assert recs and {r.study for r in recs} == {"kda_verify"}
