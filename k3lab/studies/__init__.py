"""Study modules: one per notebook topic, so a notebook, the CLI and the tests run the same code.

Each study module exposes NAME, case_names(preset=None), run(preset=None, cases=None) -> list[Record]
(checks every variant against the reference first, then times) and profile_targets(preset=None).
`STUDIES` lists them in notebook order; `load_study(name)` imports one only when asked, so that a study
that is slow to import (Triton kernels, fla) costs nothing to the others.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

STUDIES: dict[str, str] = {
    "launch_overhead": "k3lab.studies.launch_overhead",
    "copy_removal": "k3lab.studies.copy_removal",
    "mla_padding": "k3lab.studies.mla_padding",
    "kda_scan": "k3lab.studies.kda_scan",
    "kda_verify": "k3lab.studies.kda_verify",
    "kda_precision": "k3lab.studies.kda_precision",
    "draft_depth": "k3lab.studies.draft_depth",
}

_REQUIRED = ("NAME", "case_names", "run", "profile_targets")


class StudyNotAvailable(ImportError):
    """A registered study whose module is not in this tree (not written yet)."""


def load_study(name: str) -> ModuleType:
    """Import and return the study module `name` (a key of STUDIES).

    ValueError for a name not in STUDIES; StudyNotAvailable (an ImportError) when the module does not
    exist yet; ImportError from the module itself is left as is (a real bug, not an absence)."""
    if name not in STUDIES:
        raise ValueError(f"unknown study {name!r}; known studies: {', '.join(STUDIES)}")
    path = STUDIES[name]
    if importlib.util.find_spec(path) is None:
        raise StudyNotAvailable(f"study {name!r} is registered but its module {path} does not exist yet")
    module = importlib.import_module(path)
    missing = [attr for attr in _REQUIRED if not hasattr(module, attr)]
    if missing:
        raise StudyNotAvailable(f"study module {path} lacks {', '.join(missing)} (the study contract: "
                                f"{', '.join(_REQUIRED)})")
    return module


def available() -> list[str]:
    """Registered studies whose modules exist in this tree."""
    return [n for n, p in STUDIES.items() if importlib.util.find_spec(p) is not None]
