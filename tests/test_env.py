"""k3lab.env: backend detection, peaks and the preset choice."""

import torch

from k3lab import env


def test_detect_matches_torch():
    info = env.detect()
    if torch.cuda.is_available():
        assert info.backend == ("rocm" if torch.version.hip else "cuda")
        assert info.compute_units > 0
    else:
        assert info.backend == "cpu"
        assert env.default_preset(info) == "tiny"
    assert info is env.detect()  # detected once


def test_peak_lookup_by_name():
    assert env._peak_for("NVIDIA H200").bandwidth_tbs == 4.25
    assert env._peak_for("AMD Instinct MI355X gfx950").compute_units == 256
    assert env._peak_for("some laptop").name == "CPU"
    for peak in env.PEAKS.values():
        assert peak.bandwidth_tbs > 0 and peak.bf16_tflops > 0
        assert peak.bandwidth_source and peak.bf16_source


def test_describe_and_optional_backends_say_what_is_used():
    line = env.describe()
    assert line.startswith("k3lab: backend=") and "torch=" in line and "preset=" in line
    found = env.optional_backends()
    assert set(found) >= {"triton", "fla", "aiter", "rocprofv3"}
    for name, status in found.items():
        assert status.startswith("found") or "missing:" in status, (name, status)


def test_quiet_silences_only_the_known_harmless_warnings():
    import warnings

    import numpy as np

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        env.quiet()
        np.nanmax(np.array([np.nan, np.nan]))
        warnings.warn("something else", RuntimeWarning)
    assert [str(w.message) for w in seen] == ["something else"]
