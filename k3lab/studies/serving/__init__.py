"""Study: the serving curve, tokens/s/GPU against tokens/s/user on one node of 8 GPUs (notebook 09).

Cases:
    grid          (GPU) the decode step over batch x context (`measure.measure_grid`; a tiny grid on a CPU)
    validation    the step model's held-out points: one record per point, measured and predicted, with
                  extra.rel_err (predicted / measured - 1); device: the device that measured the step
    curve_h200    the Pareto front per rung of the article's order, from the H200's fitted steps with 288 GB
                  per GPU (an H200's 141 GB cannot hold a rank's FP4 weights): a configuration nobody
                  measured, labelled modelled and filed under profiles/projected/ (below)
    curve_mi355x  the same projected to MI355X (its bandwidth, matrix rate, memory and link), labelled so
                  and filed under profiles/projected/ (below)
Curve records carry extra.tokens_per_s_user (P90) and extra.tokens_per_s_gpu, mode 'model', median_us the
cycle time; k3lab.serving.inputs gathers what the model reads from the committed records.

Where curve records live: a curve is the model's output, no measurement of any device, so every curve is
filed apart from every measured device's folder, under profiles/projected/<device-slug>/serving/
(bench.records.PROJECTED; save_records puts a record there when extra['projected'] is True). Its `device`
names the configuration and says what it is (`curve_device`): projected to another GPU ('AMD Instinct
MI355X (projected from NVIDIA H200 records)', `projected_device`) or modelled on the measured GPU given
memory it lacks ('NVIDIA H200 with 288 GB (modelled from NVIDIA H200 records)', `modelled_device`);
extra['projected_from'] names the measured device and the records the model read, extra
['measured_or_modelled'] says 'projected' or 'modelled from H200 step records'. Filed under the H200's
folder with the H200 as device, every reader of "the H200's records" (bench.load_records(device=...),
roofline.ceilings, the records' trend, the README and report tables) could take it for an H200 timing, and
an AMD name in a top-level folder would read as an AMD run (k3lab.studies.runs). `projected_records` reads
them back. The measured grid (grid.*) and the held-out checks (validate.*: the measured step beside the
model's prediction) stay in the H200's folder.
"""

from __future__ import annotations

import datetime as _dt

from k3lab import bench
from k3lab.bench.records import PROJECTED

from . import measure

NAME = "serving"
H200_MEMORY_GB = 288.0  # the H200 curve's memory per GPU: K3's FP4 weights do not fit in 141 GB
SOURCE_DEVICE = "NVIDIA H200"  # the device whose measured steps the model is fitted to (inputs.DEVICE)


def projected_device(gpu_name: str, source: str = SOURCE_DEVICE) -> str:
    """The `device` of a projected record: the target GPU's name, then that it is projected and from what
    ('AMD Instinct MI355X (projected from NVIDIA H200 records)')."""
    if not isinstance(gpu_name, str) or not gpu_name.strip():
        raise ValueError(f"gpu_name: expected a GPU's name such as 'AMD Instinct MI355X', got {gpu_name!r}")
    return f"{gpu_name} (projected from {source} records)"


def modelled_device(gpu_name: str, memory_gb: float, source: str = SOURCE_DEVICE) -> str:
    """The `device` of a curve modelled on the measured GPU given memory it lacks: 'NVIDIA H200 with 288 GB
    (modelled from NVIDIA H200 records)'."""
    if not isinstance(gpu_name, str) or not gpu_name.strip():
        raise ValueError(f"gpu_name: expected a GPU's name such as 'NVIDIA H200', got {gpu_name!r}")
    if not isinstance(memory_gb, (int, float)) or isinstance(memory_gb, bool) or not memory_gb > 0:
        raise ValueError(f"memory_gb: expected the memory per GPU in GB (> 0), got {memory_gb!r}")
    return f"{gpu_name} with {memory_gb:g} GB (modelled from {source} records)"


def curve_device(gpu_key: str) -> str:
    """The `device` of `gpu_key`'s curve records: 'h200' modelled with H200_MEMORY_GB (`modelled_device`),
    another GPU projected (`projected_device`)."""
    from k3lab.serving import hardware

    name = hardware.gpu(gpu_key).name
    return modelled_device(name, H200_MEMORY_GB) if gpu_key == "h200" else projected_device(name)


def projected_from(sources: dict, source: str = SOURCE_DEVICE) -> dict:
    """extra['projected_from'] of a projected record: the measured device and the records the model read
    (node.Inputs.sources: folder and case names, without the routing line's fitted figure)."""
    return {"device": source, "records": {k: v for k, v in sources.items() if k != "routing"}}


def projected_records(gpu_key: str, root=None) -> list[bench.Record]:
    """The committed curve records of `gpu_key` ('h200' modelled, 'mi355x' projected), read from their own
    folder, <root or profiles>/projected/<device-slug>/serving/ (module docstring); [] when none are there."""
    from pathlib import Path

    base = Path(bench.PROFILES if root is None else root) / PROJECTED
    return bench.load_records(NAME, device=curve_device(gpu_key), root=base)


def case_names(preset=None) -> list[str]:
    """'validation', 'curve_h200', 'curve_mi355x', and 'grid' (the measured grid)."""
    return ["validation", "curve_h200", "curve_mi355x", "grid"]


def _model_record(case: str, variant: str, us: float, shape: dict, *, like=None, **extra) -> bench.Record:
    info = bench.provenance()
    src = like or {}
    return bench.Record(study=NAME, case=case, variant=variant, device=src.get("device", SOURCE_DEVICE),
                        backend=src.get("backend", "cuda"), versions=src.get("versions", info["versions"]),
                        commit=info["commit"], date=_dt.datetime.now(_dt.timezone.utc).isoformat(
                            timespec="seconds"), shape=shape, dtype="bfloat16", median_us=us, p20_us=us,
                        p80_us=us, mode="model", extra=extra)


def _measured(source: str) -> dict:
    """The measured step's record (a dict) at `source` (a path under the repository), {} when unreadable."""
    import json
    from pathlib import Path

    path = Path(bench.PROFILES).parent / source
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return (data[0] if isinstance(data, list) and data else data) or {}


def validation_records(inp=None) -> list[bench.Record]:
    """One record per held-out step: median_us measured, extra predicted_us, rel_err and the source; the
    device, backend and versions are the measured step's."""
    from k3lab.serving import inputs, stepmodel

    inp = inp or inputs.node_inputs()
    out = []
    for row in stepmodel.validation(inp.fits):
        pred, meas = row["predicted_ms"] * 1e3, row["measured_ms"] * 1e3
        label = "before" if row["variant"] == "base" else "after"
        # a shape measured by both studies is held out twice: the decode_step one gets its own case
        study = ".decode_step" if "/decode_step/" in row["source"] else ""
        out.append(_model_record(f"validate.{row['variant']}.b{row['batch']}_{row['context']}{study}", label,
                                 meas,
                                 {"batch": row["batch"], "context_len": row["context"]},
                                 like=_measured(row["source"]), predicted_us=pred, rel_err=row["rel_err"],
                                 source=row["source"], form=list(inp.fits[row["variant"]].form),
                                 coef=inp.fits[row["variant"]].coef))
    return out


def curve_records(gpu_key: str, inp=None, work=None, error=None) -> list[bench.Record]:
    """One record per front point of every rung on `gpu_key` ('h200' or 'mi355x'), each with the step
    model's measured error it carries (`error`, default serving.validate.model_error(): its kind and worst
    abs(rel_err); the band around a front is serving.bands'). No curve is a measurement: each carries its
    `curve_device`, extra projected and projected_from, and is saved under profiles/projected/."""
    from k3lab.serving import curve, hardware, inputs, validate

    inp = inp or inputs.node_inputs()
    work = work or curve.agent_workload()
    error = error or validate.model_error()
    g = hardware.gpu(gpu_key)
    mem = H200_MEMORY_GB if gpu_key == "h200" else None
    # every curve is the model's output: its own device name and folder (module docstring)
    like = {"device": curve_device(gpu_key)}
    where = {"projected": True, "projected_from": projected_from(inp.sources)}
    out = []
    for i, row in enumerate(curve.ladder(inp, g, work, memory_gb=mem)):
        for p in row["front"]:
            out.append(_model_record(
                f"curve.{gpu_key}.r{i}.dcp{p['dcp']}_k{p['depth']}_c{p['concurrency']}",
                "after" if i == len(curve.RUNGS) - 1 else "before", p["cycle_ms"] * 1e3,
                {"concurrency": p["concurrency"], "dcp": p["dcp"], "depth": p["depth"]},
                like=like, rung=row["rung"], section=row["section"], gpu=g.name, **where,
                measured_or_modelled="projected" if gpu_key != "h200" else "modelled from H200 step records",
                tokens_per_s_user=p["tokens_per_s_user"], tokens_per_s_gpu=p["tokens_per_s_gpu"],
                hit_rate=p["hit_rate"], committed=p["committed"], terms_us=p["terms_us"],
                memory_gb=mem or g.memory_gb, workload=work.source, step_model_error_kind=error["kind"],
                step_model_error_worst=error["worst"]))
    return out


def run(preset=None, cases=None, *, repeats: int = 5) -> list:
    """The records of `cases` (see case_names); the model's cases read committed records only."""
    from k3lab.serving import inputs, validate
    from k3lab.studies import select_cases

    out, inp, err = [], None, None
    for case in select_cases(case_names(preset), cases):
        if case == "grid":
            out += measure.measure_grid(repeats=repeats)
            continue
        inp = inp or inputs.node_inputs()
        if case == "validation":
            out += validation_records(inp)
            continue
        err = err or validate.model_error()
        out += curve_records(case.split("_")[1], inp, error=err)
    return out


def profile_targets(preset=None) -> dict:
    """Nothing to profile: the grid's steps are the decode_step study's (`k3lab profile decode_step`)."""
    return {}
