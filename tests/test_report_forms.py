"""The report's forms (quick by default, --full) and its overall progress: which cases each study runs
on a GPU and on a CPU, the ETA's arithmetic, the bar and the plain lines, and what the page says."""

import inspect
import io
import json

import pytest
import torch
from cpu_child import on_a_cpu

from k3lab import cli, studies
from k3lab.report import eta
from k3lab.report.eta import Plan, Progress, expected_seconds, fmt_duration
from k3lab.studies import CPU_CASES, CPU_KWARGS, GPU_ONLY, GPU_QUICK, STUDIES, load_study, report_form

REPO = eta.REPO


# ------------------------------------------------------------------ the forms
def test_every_study_has_a_quick_form_on_both_kinds_of_machine():
    assert set(GPU_QUICK) == set(STUDIES)
    assert set(CPU_CASES) | GPU_ONLY == set(STUDIES)
    for name in STUDIES:
        full = report_form(name, gpu=True, full=True)
        assert full.cases is None and full.form == "full" and not full.kwargs
        q = report_form(name, gpu=True)
        assert q.form == "quick" and q.why == GPU_QUICK[name].why
        assert q.cases == (None if GPU_QUICK[name].cases is None else list(GPU_QUICK[name].cases))
        assert q.kwargs == GPU_QUICK[name].kwargs and q.kwargs is not GPU_QUICK[name].kwargs  # a copy
        if name not in GPU_ONLY:
            cpu = report_form(name, gpu=False)
            assert cpu.cases == CPU_CASES[name] and cpu.kwargs == CPU_KWARGS.get(name, {})
            inspect.signature(load_study(name).run).bind(preset=None, cases=cpu.cases, **cpu.kwargs)
            if cpu.cases is not None and not torch.cuda.is_available():  # a GPU machine lists its own cases
                assert set(cpu.cases) <= set(load_study(name).case_names()), name
    assert report_form("kda_decode", gpu=True).cases == ["B1_H12", "B128_H12"]
    with pytest.raises(ValueError, match=r"unknown study 'kda_decode_bench'; known studies: .*kda_decode"):
        report_form("kda_decode_bench", gpu=True)  # a former name is refused, not translated
    with pytest.raises(ValueError, match="unknown study 'nope'"):
        report_form("nope", gpu=True)


def _pretend_gpu(monkeypatch):
    """What the studies see on an H200: env.detect() says CUDA, torch.cuda.is_available() is True (the
    study modules are imported before, so nothing else is touched), and no .cu kernel builds."""
    from k3lab import env
    from k3lab.ops import kda_verify as kv

    h200 = env.DeviceInfo("cuda", "NVIDIA H200", 132, 150.0, 32, "sm_90", env.PEAKS["H200"])
    monkeypatch.setattr(env, "detect", lambda: h200)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(kv.BACKENDS, "status", lambda: {"cuda": (False, "not built in this test")})


def test_gpu_quick_cases_are_cases_the_study_has_on_a_gpu_and_run_takes_the_keywords(monkeypatch):
    modules = {name: load_study(name) for name in STUDIES}
    _pretend_gpu(monkeypatch)
    for name, mod in modules.items():
        q = GPU_QUICK[name]
        known = mod.case_names()
        if q.cases is not None:
            assert q.cases and set(q.cases) <= set(known), (name, sorted(set(q.cases) - set(known)))
            assert len(set(q.cases)) == len(q.cases), name
        inspect.signature(mod.run).bind(preset=None, cases=q.cases, **q.kwargs)  # TypeError if it cannot
        assert q.budget_s > 0 and q.why, name
    # the slow cases of the issue are --full's: decode_step's B = 64 / 8K, kda_scan's grid
    assert GPU_QUICK["decode_step"].cases == ("b1_1k",)
    assert "b64_8k" in modules["decode_step"].case_names() and len(modules["kda_scan"].case_names()) > 1


def test_the_quick_gpu_report_is_planned_within_ten_minutes():
    # the table's own arithmetic: kernels, then every study's budget, then 12 notebooks as many at a time
    # as a GPU machine runs by default
    assert eta.default_workers("gpu") == 4 and eta.default_workers("cpu") == 2
    plan = Plan(workers=eta.default_workers("gpu"))
    plan.add("kernels", expected_seconds("gpu", "quick", "kernels"))
    for name in STUDIES:
        plan.add(f"study:{name}", expected_seconds("gpu", "quick", f"study:{name}"))
    nbs = [k for k in eta.EXPECTED_S["gpu"] if k.startswith("notebook:")]
    assert len(nbs) == 12
    for k in nbs:
        plan.add(k, expected_seconds("gpu", "quick", k), parallel=True)
    assert plan.eta(0.0) <= 600, plan.eta(0.0)  # the target; the H200 took 553 s (profiles/.../gpu_check)
    full = sum(expected_seconds("gpu", "full", f"study:{n}") for n in STUDIES)
    assert full > 1000  # what --full costs on the H200 (measured: 1,045 s of studies)


H100_TIMINGS = REPO / "profiles" / "nvidia-h100-80gb-hbm3" / "gpu_check" / "report_timings_2b4119a.json"


def test_the_serving_run_quick_form_keeps_the_h100_report_under_nine_minutes():
    """The measured serving run in the report: on a GPU the brief form (three concurrencies, a budget the
    study stops at, first run aside), whose ETA budget covers its own; with it, the H100's measured
    default report (each step's seconds, as scheduled) stays under 9 minutes."""
    from k3lab.studies import serving_run

    q = GPU_QUICK["serving_run"]
    assert q.kwargs["form"] == "brief" and q.cases == serving_run.BRIEF
    assert 0 < q.kwargs["budget_s"] < q.budget_s  # the study stops before the ETA's figure
    dur, drain = serving_run.RUN_S["brief"]
    assert dur + drain < q.kwargs["budget_s"] / 2  # at least the first run fits beside the setup
    actual, workers = _recorded(H100_TIMINGS)
    assert "study:serving_run" not in actual  # the record is of the report before it
    before = max(end for _, end in _schedule(actual, workers).values())
    actual["study:serving_run"] = q.budget_s
    studies_first = dict(sorted(actual.items(), key=lambda kv: kv[0].startswith("notebook:")))
    after = max(end for _, end in _schedule(studies_first, workers).values())
    assert after == pytest.approx(before + q.budget_s) and after <= 540, (before, after)
    full = report_form("serving_run", gpu=True, full=True)
    assert full.cases is None and not full.kwargs  # run()'s default: the full form, every case


@on_a_cpu  # the study's CPU form (tiny preset, CPU tensors)
def test_the_report_runs_the_serving_run_and_shows_its_own_table(tmp_path, capfd):
    from k3lab import report
    from k3lab.studies import serving_run

    out = tmp_path / "out"
    report.build_report(out=out, run_notebooks=False, studies=["serving_run"], tty=False)
    page = (out / "report.html").read_text()
    section = page.split("id='study-serving_run'", 1)[1]
    assert "TTFT P90 (ms)" in section and "TPOT P90 (ms)" in section and "total tok/s/GPU" in section
    assert "model vs measured: TTFT P50 (%)" in section  # the model beside each run, as its error
    assert serving_run.REPORT_NOTE["cpu"].split(":")[0] in section
    for case in serving_run.CPU_CASES:
        assert f"<td>{case}</td>" in section, case
    recs = [r for r in __import__("k3lab").bench.load_records(study="serving_run", root=out / "records")]
    assert sorted(r.case for r in recs) == sorted(serving_run.CPU_CASES)
    took = json.loads((out / "timings.json").read_text())["steps"]["study:serving_run"]["seconds"]
    assert took < 4 * eta.EXPECTED_S["cpu"]["study:serving_run"], took  # seconds, as the table says
    assert "study serving_run: passed" in capfd.readouterr().err


def test_the_notebooks_see_where_the_reports_records_are(tmp_path, monkeypatch):
    """While the report's notebooks run, RECORDS_ENV names its out/records (notebook 09 reads this run's
    serving-run records there instead of running the study again); after, it is as before."""
    import os

    from k3lab import report
    from k3lab.studies import serving_run

    seen = {}

    def notebooks(paths, out, *args, **kwargs):
        seen["env"] = os.environ.get(report.RECORDS_ENV)
        seen["root"] = serving_run.report_records()
        return [], False

    monkeypatch.setattr(report, "_run_notebooks", notebooks)
    monkeypatch.delenv(report.RECORDS_ENV, raising=False)
    nbs = tmp_path / "nbs"
    nbs.mkdir()
    (nbs / "01_x.ipynb").write_text("{}")
    out = tmp_path / "out"
    report.build_report(out=out, run_studies=False, notebooks=nbs, tty=False)
    assert seen["env"] == str((out / "records").resolve()) and seen["root"] == (out / "records").resolve()
    assert report.RECORDS_ENV not in os.environ
    assert serving_run.report_records() is None  # outside a report: no fresh records



def test_the_notebooks_start_longest_first_and_the_page_keeps_file_order(tmp_path, monkeypatch):
    """The report hands the notebooks to its workers in order of their expected seconds, longest first
    (ties in file order), so the last to start is a short one; the plan's ETA schedules them in that
    order and the page lists them in file order. A planted start order that loses a notebook is refused."""
    from k3lab import report
    from k3lab.report import workers as pool

    seconds = {"00_a": 10.0, "01_b": 90.0, "02_c": 10.0, "03_d": 40.0}
    real = report.expected_seconds
    monkeypatch.setattr(report, "expected_seconds", lambda kind, form, step, measured=None: (
        seconds[step.split(":", 1)[1]] if step.startswith("notebook:") else real(kind, form, step, measured)))
    seen = {}

    def run_notebooks(paths, out_dir, timeout_s, workers, started=None, ended=None, memory=None,
                      retried=None):
        seen["order"], seen["memory"] = [p.stem for p in paths], memory
        got = {}
        for p in paths:
            started(p)
            got[p] = pool.Outcome("passed", seconds=1.0)
            ended(p, got[p])
        return got, False

    monkeypatch.setattr(pool, "run_notebooks", run_notebooks)
    nbs = tmp_path / "nbs"
    nbs.mkdir()
    for stem in seconds:
        (nbs / f"{stem}.ipynb").write_text("{}")
    out = tmp_path / "out"
    report.build_report(out=out, run_studies=False, notebooks=nbs, tty=False, workers=2)
    assert seen["order"] == ["01_b", "03_d", "00_a", "02_c"]
    assert (seen["memory"] is None) == (not torch.cuda.is_available())  # GPU memory is shared on a GPU only
    page = (out / "report.html").read_text()
    assert [page.index(f"notebooks/{s}.html") for s in seconds] == sorted(
        page.index(f"notebooks/{s}.html") for s in seconds)

    paths = sorted(nbs.glob("*.ipynb"))
    with pytest.raises(ValueError, match="start_order must hold the same notebooks"):
        report._run_notebooks(paths, out, 60, 2, 0.0, report.Checks(), [], start_order=paths[:-1])


# ------------------------------------------------------------------ the ETA
def test_expected_seconds_reads_the_table_and_the_budgets():
    assert expected_seconds("gpu", "quick", "study:decode_step") == GPU_QUICK["decode_step"].budget_s
    assert expected_seconds("gpu", "full", "study:decode_step") == 397
    cpu = eta.EXPECTED_S["cpu"]
    assert expected_seconds("cpu", "quick", "notebook:05_kda_scan") == cpu["notebook:05_kda_scan"]
    assert expected_seconds("cpu", "full", "study:kda_scan") == cpu["study:kda_scan"]
    assert expected_seconds("gpu", "quick", "notebook:99_new") == eta.DEFAULT_S["gpu"]
    with pytest.raises(ValueError, match="kind must be"):
        expected_seconds("tpu", "quick", "kernels")
    with pytest.raises(ValueError, match="form must be"):
        expected_seconds("gpu", "fast", "kernels")


def test_eta_adds_serial_steps_and_schedules_notebooks_on_the_workers():
    plan = Plan(workers=2)
    plan.add("study:a", 100)
    plan.add("study:b", 50)
    for name, s in (("n1", 40), ("n2", 30), ("n3", 20), ("n4", 10)):
        plan.add(f"notebook:{name}", s, parallel=True)
    # 150 s of studies, then notebooks greedily on two slots: [40, 30] -> n3 on 30 -> n4 on 40: max 50
    assert plan.eta(0.0) == pytest.approx(150 + 50)
    assert (plan.done, plan.total) == (0, 6)
    plan.start("study:a", 0.0)
    assert plan.eta(30.0) == pytest.approx(70 + 50 + 50)  # what is left of the running study
    # an overrun: a floor and a share of the overrun are left (the ETA keeps moving, never counts it done)
    assert plan.eta(500.0) == pytest.approx(eta.OVERRUN_FLOOR_S + eta.OVERRUN_SHARE * 400 + 50 + 50)
    plan.finish("study:a", 100.0)  # exactly as expected: no rescaling
    assert plan.scale() == pytest.approx(1.0) and plan.eta(100.0) == pytest.approx(100)
    plan.start("study:b", 100.0)
    plan.finish("study:b", 250.0)  # 150 s for 50 expected: the rest is scaled by (250 + 60) / (150 + 60)
    k = (250 + eta.PRIOR_S) / (150 + eta.PRIOR_S)
    assert plan.scale() == pytest.approx(k)
    assert plan.eta(250.0) == pytest.approx(50 * k)
    plan.start("notebook:n1", 250.0)
    plan.start("notebook:n2", 250.0)
    # 10 s later: slots [40k - 10, 30k - 10]; n3 goes to the second, n4 to the first
    slots = sorted([40 * k - 10, 30 * k - 10])
    slots[0] += 20 * k
    slots = sorted(slots)
    slots[0] += 10 * k
    assert plan.eta(260.0) == pytest.approx(max(slots))
    for name in ("n1", "n2", "n3", "n4"):
        plan.finish(f"notebook:{name}", 300.0)
    assert plan.eta(300.0) == 0 and plan.summary(300.0, 300.0) == "all 6 done in 5 min 00 s"


def test_the_scale_is_clamped_and_damped():
    plan = Plan()
    plan.add("a", 10)
    plan.add("b", 10)
    plan.start("a", 0.0)
    plan.finish("a", 1000.0)  # a hundred times slower than expected
    assert plan.scale() == eta.SCALE_LIMITS[1]
    fast = Plan()
    fast.add("a", 1000)
    fast.add("b", 10)
    fast.start("a", 0.0)
    fast.finish("a", 1.0)
    assert fast.scale() == eta.SCALE_LIMITS[0]
    short = Plan()
    short.add("a", 1)
    short.add("b", 100)
    short.start("a", 0.0)
    short.finish("a", 3.0)  # three times slower, but only 2 s late: barely moves the estimate
    assert 1.0 < short.scale() < 1.05


# ------------------------------------------------------------------ the ETA against recorded runs
H200_TIMINGS = REPO / "profiles" / "nvidia-h200" / "gpu_check" / "report_timings_a20b24e.json"
MID_RUN = (0.2, 0.8)  # the share of a run over which the ETA is held to within 25% of what is left
# `k3lab report` (quick form, two notebooks at a time) on a 2-core CPU that other jobs shared: each step's
# seconds and the table's expected seconds of the time, as its timings.json gave them
CPU_RUN = {
    "study:launch_overhead": (1.5, 7), "study:copy_removal": (1.3, 14), "study:mla_padding": (5.5, 30),
    "study:kda_scan": (11.2, 30), "study:kda_verify": (2.4, 7), "study:kda_precision": (6.8, 35),
    "study:draft_depth": (8.0, 50), "study:decode_step": (104.9, 155), "study:agent_cache": (1.0, 5),
    "study:serving": (1.6, 25), "notebook:00_k3_anatomy": (21.6, 85), "notebook:01_dcp": (15.4, 45),
    "notebook:02_moe_sharding": (13.1, 20), "notebook:03_copy_removal": (28.9, 120),
    "notebook:04_mla_padding": (52.4, 100), "notebook:04b_mla_deep_dive": (9.7, 20),
    "notebook:05_kda_scan": (55.1, 160), "notebook:05b_kda_deep_dive": (74.7, 60),
    "notebook:06_draft_depth": (57.0, 75), "notebook:07_agent_cache": (68.9, 45),
    "notebook:08_all_together": (16.2, 15), "notebook:09_serving_curve": (34.0, 45),
}


def _schedule(seconds: dict[str, float], workers: int) -> dict[str, tuple[float, float]]:
    """(start, end) of each step as the report runs them: every study in order, then the notebooks in
    order, `workers` at a time, each taking the first free slot."""
    t, times = 0.0, {}
    for key, s in seconds.items():
        if not key.startswith("notebook:"):
            times[key] = (t, t + s)
            t += s
    slots = [t] * workers
    for key, s in seconds.items():
        if key.startswith("notebook:"):
            i = min(range(workers), key=slots.__getitem__)
            times[key] = (slots[i], slots[i] + s)
            slots[i] += s
    return times


def _replay(expected: dict[str, float], actual: dict[str, float], workers: int, step_s: float = 1.0):
    """The ETA a run whose steps take `actual` seconds shows each `step_s` when it expects `expected`:
    [(t, eta, seconds really left)]."""
    times = _schedule(actual, workers)
    total = max(end for _, end in times.values())
    shown, t = [], 0.0
    while t < total:
        plan = Plan(workers=workers)
        for key in actual:
            plan.add(key, expected[key], parallel=key.startswith("notebook:"))
        for key, (start, end) in times.items():
            if start <= t:
                plan.start(key, start)
            if end <= t:
                plan.finish(key, end)
        shown.append((t, plan.eta(t), total - t))
        t += step_s
    return shown


def _worst_mid_run(shown) -> float:
    total = shown[-1][0] + shown[-1][2]
    lo, hi = MID_RUN
    return max(abs(e - left) / left for t, e, left in shown if lo * total <= t <= hi * total)


def _recorded(path):
    data = json.loads(path.read_text())
    return {k: v["seconds"] for k, v in data["steps"].items()}, data["workers"]


@pytest.mark.parametrize("machine", ["h200", "cpu"])
def test_the_eta_from_a_measured_run_stays_within_a_quarter_mid_run(machine):
    """Two recorded reports (each step's seconds): the H200's, against which its ETA table of the time
    was 47% off mid-run, and a 2-core CPU's (the table: 55% off). From the measured seconds of the same
    kind of machine, a rerun that goes as measured, 20% faster or 25% slower overall with each step 10%
    off either way stays within 25% of what is really left."""
    import random

    if machine == "h200":
        actual, workers = _recorded(H200_TIMINGS)
        table = {k: v["expected"] for k, v in json.loads(H200_TIMINGS.read_text())["steps"].items()}
    else:
        actual, workers = {k: s for k, (s, _) in CPU_RUN.items()}, 2
        table = {k: e for k, (_, e) in CPU_RUN.items()}
    assert _worst_mid_run(_replay(table, actual, workers)) > 0.4  # the tables were far off
    assert _worst_mid_run(_replay(actual, actual, workers)) < 0.05
    rng = random.Random(0)
    for load in (0.8, 1.0, 1.25):
        for _ in range(3):
            rerun = {k: s * load * rng.uniform(0.9, 1.1) for k, s in actual.items()}
            worst = _worst_mid_run(_replay(actual, rerun, workers))
            assert worst < 0.25, f"load x{load}: the ETA was {worst:.0%} off mid-run"


def test_the_eta_keeps_moving_while_a_long_step_overruns():
    """A notebook measured at 20 s whose one cell takes 658 s (notebook 02 on a loaded CPU): the ETA
    shown never stays the same for more than 5 s while it runs."""
    plan = Plan(workers=2)
    plan.add("study:a", 30)
    plan.add("notebook:slow", 20, parallel=True)
    plan.add("notebook:next", 40, parallel=True)
    plan.add("notebook:last", 60, parallel=True)
    plan.start("study:a", 0.0)
    plan.finish("study:a", 30.0)
    plan.start("notebook:slow", 30.0)
    plan.start("notebook:next", 30.0)
    plan.finish("notebook:next", 70.0)
    plan.start("notebook:last", 70.0)
    plan.finish("notebook:last", 130.0)
    shown = [(t / 10, fmt_duration(plan.eta(t / 10))) for t in range(300, 6880)]
    held, longest = shown[0], 0.0
    for t, text in shown:
        if text != held[1]:
            held = (t, text)
        longest = max(longest, t - held[0])
    assert longest <= 5.0, f"the ETA stood still for {longest:.1f} s"
    assert plan.eta(400.0) > plan.eta(200.0)  # past its estimate, what is left grows with what it ran


def test_expected_seconds_come_from_the_last_run_of_this_machine_kind(tmp_path):
    machine = {"kind": "cpu", "device": "x86_64", "cpus": 2}
    steps = {"study:kda_scan": {"seconds": 7.0}, "notebook:02_moe_sharding": {"seconds": 249.0},
             "notebook:05_kda_scan": {"seconds": 3.0, "status": "interrupted"},
             "notebook:08_all_together": {"seconds": 16.2, "status": "failed"},
             "notebook:09_serving_curve": {"seconds": 240.5, "status": "timeout"}}
    last = tmp_path / "timings.json"
    last.write_text(json.dumps({"machine": "cpu", "machine_kind": machine, "form": "quick", "steps": steps}))
    measured, source = eta.measured_seconds(machine, "quick", [last])
    assert source == last and measured == {"study:kda_scan": 7.0, "notebook:02_moe_sharding": 249.0,
                                           "notebook:09_serving_curve": 240.5}
    assert expected_seconds("cpu", "quick", "notebook:02_moe_sharding", measured) == 249.0
    # an interrupted or failed step's seconds are not a whole step's: the table's
    assert (expected_seconds("cpu", "quick", "notebook:05_kda_scan", measured)
            == eta.EXPECTED_S["cpu"]["notebook:05_kda_scan"])
    # another core count, another device, another form: not this machine's measurements
    for other, form in (({**machine, "cpus": 16}, "quick"), ({**machine, "device": "arm64"}, "quick"),
                        (machine, "full")):
        assert eta.measured_seconds(other, form, [last]) == ({}, None)
    # a file written before the machine kind was kept matches by its environment line's device
    h200 = {"kind": "gpu", "device": "NVIDIA H200", "cpus": 16}
    measured, source = eta.measured_seconds(h200, "quick", eta.timing_files(tmp_path / "none"))
    assert source == H200_TIMINGS and measured["study:decode_step"] == 49.3
    assert eta.timing_files(tmp_path)[0] == last  # the build folder's last run comes first


def test_the_report_takes_its_eta_from_its_last_run(tmp_path, capfd):
    from k3lab import report

    out = tmp_path / "out"
    report.build_report(out=out, run_notebooks=False, studies=["launch_overhead"], tty=False)
    first = capfd.readouterr().err
    assert "from the table of expected seconds" in first or "from the steps' seconds in" in first
    took = json.loads((out / "timings.json").read_text())["steps"]["study:launch_overhead"]["seconds"]
    report.build_report(out=out, run_notebooks=False, studies=["launch_overhead"], tty=False)
    second = capfd.readouterr().err
    assert f"from the steps' seconds in {out / 'timings.json'}" in second
    gpu = torch.cuda.is_available()
    if not gpu:  # one step, expected as long as it took last time
        assert f"expected about {fmt_duration(took)} on this CPU" in second


def test_plan_rejects_bad_input():
    with pytest.raises(ValueError, match="workers must be a positive integer"):
        Plan(workers=0)
    plan = Plan()
    plan.add("a", 1)
    with pytest.raises(ValueError, match="already in the plan"):
        plan.add("a", 2)
    with pytest.raises(ValueError, match="expected_s of 'b'"):
        plan.add("b", -1)
    with pytest.raises(ValueError, match="expected_s of 'c'"):
        plan.add("c", float("nan"))
    with pytest.raises(KeyError, match="no step 'z'"):
        plan.start("z", 0.0)
    assert plan.get("z") is None and plan.get("a").expected == 1


def test_durations_read_as_minutes():
    assert [fmt_duration(s) for s in (0, 44.6, 60, 250, 3725)] == ["0 s", "45 s", "1 min 00 s", "4 min 10 s",
                                                                   "1 h 02 min"]


# ------------------------------------------------------------------ the display
def _plan(n=3):
    plan = Plan(workers=1)
    for i in range(n):
        plan.add(f"study:s{i}", 100)
    return plan


def test_plain_lines_off_a_terminal_say_the_count_and_the_eta():
    out = io.StringIO()
    with Progress(_plan(), t0=0.0, stream=out, tty=False, interval_s=3600) as bar:
        eta.say(0.0, "study s0: started")
        bar.start("study:s0")
        bar.finish("study:s0")
    lines = out.getvalue().splitlines()
    assert lines[0].endswith("overall: 0/3 done, ETA 5 min 00 s")
    assert any(ln.endswith("study s0: started") for ln in lines)
    assert "overall: 1/3 done, ETA" in lines[-2] and "overall: 1/3 done" in lines[-1]
    assert "\r" not in out.getvalue()  # a log stays one line per event


def test_without_a_sized_terminal_the_lines_are_plain(tmp_path):
    """A pseudo-terminal that reports no size (as some CI runners give) drew nothing at all with a bar:
    there, as in a pipe, the plain lines come at their interval."""
    import fcntl
    import os
    import pty
    import struct
    import subprocess
    import sys
    import termios

    assert eta.PLAIN_INTERVAL_S <= 15 and not eta.has_terminal(io.StringIO())
    code = ("import time\nfrom k3lab.report.eta import Plan, Progress, has_terminal\n"
            "import sys\nprint('terminal:', has_terminal(sys.stderr), file=sys.stderr, flush=True)\n"
            "p = Plan(workers=1)\np.add('study:a', 3)\n"
            "with Progress(p, time.time(), interval_s=0.3) as bar:\n"
            "    bar.start('study:a')\n    time.sleep(1.2)\n    bar.finish('study:a')\n")
    for rows, cols, terminal in ((0, 0, False), (24, 80, True)):
        main, child = pty.openpty()
        fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
        run = subprocess.Popen([sys.executable, "-c", code], stdin=child, stdout=child, stderr=child,
                               cwd=REPO, env={**os.environ, "TERM": "xterm"})
        os.close(child)
        text = b""
        while True:
            try:
                chunk = os.read(main, 4096)
            except OSError:
                break
            if not chunk:
                break
            text += chunk
        os.close(main)
        assert run.wait(timeout=60) == 0
        said = text.decode(errors="replace")
        assert f"terminal: {terminal}" in said
        if terminal:
            assert "k3lab report:" in said and "\r" in said  # the bar, redrawn in place
        else:
            lines = [ln for ln in said.splitlines() if "overall:" in ln]
            assert len(lines) >= 3 and "overall: all 1 done" in lines[-1], said


def test_plain_lines_repeat_on_their_interval():
    import time

    out = io.StringIO()
    with Progress(_plan(), t0=time.time(), stream=out, tty=False, interval_s=0.05):
        time.sleep(0.3)
    assert out.getvalue().count("overall: 0/3 done") >= 3


def test_the_bar_on_a_terminal_shows_the_plan_eta_and_keeps_lines_above_it():
    out = io.StringIO()
    with Progress(_plan(2), t0=0.0, stream=out, tty=True, interval_s=3600) as bar:
        eta.say(0.0, "study s0: started")
        bar.start("study:s0")
        bar.finish("study:s0")
        bar.start("study:s1")
        bar.finish("study:s1")
    text = out.getvalue()
    assert "k3lab report:" in text and "0/2 done, ETA 3 min 20 s" in text and "all 2 done" in text
    assert "study s0: started\n" in text
    assert eta._ACTIVE is None  # lines go straight to stderr again


# ------------------------------------------------------------------ the command and the page
def test_cli_report_passes_full_and_workers(monkeypatch, tmp_path):
    seen = {}

    def fake(**kw):
        seen.update(kw)
        return tmp_path / "report.html"

    import k3lab.report

    monkeypatch.setattr(k3lab.report, "build_report", fake)
    assert cli.main(["report", "--out", str(tmp_path), "--full", "--workers", "3", "--skip-notebooks"]) == 0
    assert seen["full"] is True and seen["workers"] == 3 and seen["run_notebooks"] is False
    assert cli.main(["report", "--out", str(tmp_path)]) == 0
    # None: build_report picks eta.default_workers for the machine
    assert seen["full"] is False and seen["workers"] is None
    with pytest.raises(SystemExit):
        cli.main(["report", "--workers", "0"])


@pytest.mark.parametrize("full", [False, True])
def test_the_page_and_the_lines_say_which_form_ran(tmp_path, capfd, full):
    from k3lab import report

    out = tmp_path / "out"
    report.build_report(out=out, run_notebooks=False, studies=["launch_overhead"], full=full, tty=False)
    page = (out / "report.html").read_text()
    err = capfd.readouterr().err
    form = "full" if full else "quick"
    assert f"Studies: {form} form" in page and f"{form} form: every case" in page
    assert f"study launch_overhead: started ({form} form: every case)" in err
    gpu = torch.cuda.is_available()  # a GPU run builds the .cu kernels first: one step more
    steps = 2 if gpu else 1
    assert f"overall: 0/{steps} done, ETA" in err and f"overall: all {steps} done" in err
    timings = json.loads((out / "timings.json").read_text())
    assert timings["machine"] == ("gpu" if gpu else "cpu") and timings["form"] == form
    assert timings["steps"]["study:launch_overhead"]["seconds"] > 0
    assert set(timings["steps"]) == {"study:launch_overhead"} | ({"kernels"} if gpu else set())


def test_a_quick_form_with_fewer_cases_says_so_on_the_page(tmp_path):
    from k3lab.report.sections import LiveRun, study_section

    run = LiveRun("kda_verify", [], "passed", 1.0, form="quick", cases=["b1_t4"], why="the first page's case")
    page = study_section(run, studies_root(), gpu=False)
    assert "quick form: cases b1_t4 (the first page&#x27;s case)" in page
    assert "--full</code> runs every case" in page


def studies_root():
    from k3lab import report

    return report.REPO


def test_report_form_names_a_study_with_no_form(monkeypatch):
    monkeypatch.delitem(studies.GPU_QUICK, "dcp")
    with pytest.raises(ValueError, match="study 'dcp' has no GPU quick form"):
        report_form("dcp", gpu=True)


@on_a_cpu  # the CPU form's kernels, in the interpreter on CPU tensors
def test_the_cpu_forms_one_sample_reaches_the_records():
    from k3lab.studies import kda_verify

    form = report_form("kda_verify", gpu=False)
    assert form.kwargs == {"repeats": 1}
    recs = kda_verify.run(cases=form.cases, **form.kwargs)
    assert recs and {r.extra["repeats"] for r in recs} == {1}
    with pytest.raises(ValueError, match="repeats must be a positive integer"):
        kda_verify.run(cases=form.cases, repeats=0)


def test_kernel_builds_run_in_parallel_with_the_loaders_flags_and_name_failures(monkeypatch):
    import threading
    import time

    from k3lab.ops import _build
    from k3lab.report import kernels

    if not torch.cuda.is_available():
        assert kernels.build_all() == ([], "no GPU visible to torch: nothing to build")
    names = kernels.sources()
    assert "kda_decode" in names and len(names) == len(list(_build.KERNEL_DIR.glob("*.cu")))
    calls, lock, inside = [], threading.Lock(), [0, 0]  # [now, most at once]

    def compile_kernel(name, *, kind, target, output):
        with lock:
            calls.append((name, kind, target, output))
            inside[0] += 1
            inside[1] = max(inside[1], inside[0])
        time.sleep(0.2)
        with lock:
            inside[0] -= 1
        if name == "kda_decode":
            raise _build.KernelUnavailable("nvcc failed on kernels/kda_decode.cu\nsecond line")
        return f"/cache/{name}.so"

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(_build, "device_target", lambda: ("nvcc", "sm_90a"))
    monkeypatch.setattr(_build, "find_toolchain", lambda kind: _build.Toolchain(kind, "/bin/nvcc", "v13"))
    monkeypatch.setattr(_build, "compile_kernel", compile_kernel)
    results, note = kernels.build_all()
    assert note == "nvcc for sm_90a" and sorted(c[0] for c in calls) == names
    assert all(c[1:] == ("nvcc", "sm_90a", "shared") for c in calls)  # what _build.load compiles
    assert inside[1] == len(names)  # all at once
    status = {n: s for n, _, s in results}
    assert status.pop("kda_decode") == "FAILED: nvcc failed on kernels/kda_decode.cu"
    assert set(status.values()) == {"built"}
    with pytest.raises(ValueError, match="max_workers"):
        kernels.build_all(max_workers=0)


def test_the_newest_committed_timings_come_first_whatever_their_names(tmp_path):
    machine = {"kind": "gpu", "device": "NVIDIA H100 80GB HBM3", "cpus": 16}
    folder = tmp_path / "profiles" / "nvidia-h100-80gb-hbm3" / "gpu_check"
    folder.mkdir(parents=True)
    for name, finished_at, seconds in (("report_timings_aaa.json", 100.0, 1.0),
                                       ("report_timings_zzz.json", 300.0, 3.0),
                                       ("report_timings_mmm.json", 200.0, 2.0)):
        (folder / name).write_text(json.dumps({"machine": "gpu", "machine_kind": machine, "form": "quick",
                                               "finished_at": finished_at,
                                               "steps": {"study:kda_scan": {"seconds": seconds}}}))
    files = eta.timing_files(root=tmp_path)
    assert [f.name for f in files] == ["report_timings_zzz.json", "report_timings_mmm.json",
                                       "report_timings_aaa.json"]
    assert eta.measured_seconds(machine, "quick", files)[0] == {"study:kda_scan": 3.0}
    # a file without the stamp, outside any git history, sorts after every stamped one
    (folder / "report_timings_000.json").write_text(json.dumps({"form": "quick", "steps": {}}))
    assert eta.timing_files(root=tmp_path)[-1].name == "report_timings_000.json"
