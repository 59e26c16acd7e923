"""The public peers the studies time beside k3lab's kernels, whether each runs here, and why not.

One place for the studies, the workshop's setup table and the report to ask:

- `on_gpu()`: whether the kernels run compiled on a GPU (ROCm or CUDA) rather than in Triton's
  interpreter; studies pick their GPU or CPU cases, dtypes and peers from it.
- fla (fla-core): `fla_status(needs)` -> (usable, why): a GPU and the fla modules a study calls
  (`FLA_CHUNK` for the chunked prefill, `FLA_RECURRENT` for verification, `FLA_DECODE` for the decode
  step with its convolution and gated norm). A missing or broken install is "no peer", said in the reason.
- FlashMLA: `flashmla_status(page_size)` adds the study's page size to the op's own status (an sm_90a GPU,
  the pinned library, the torch it was linked against); `flashmla_plan` binds FlashMLA's decode once per
  input set; `fetch_flashmla` downloads the pinned library (one file of one pinned vLLM wheel, hash-checked).
  The loader itself lives with the MLA op (`k3lab.ops.mla_decode.peers`), which also serves it as a backend.
- AITER: `aiter_status()`, the op's check (a ROCm torch with a device and amd-aiter; not yet run on AMD
  hardware by this project).

Every status is a (bool, str) pair: the reason says what is missing and what runs instead; absence is
never an error.
"""

from __future__ import annotations

import importlib

from k3lab import env

FLA_CHUNK = ("fla.ops.kda:chunk_kda",)
FLA_RECURRENT = ("fla.ops.kda:fused_recurrent_kda",)
FLA_DECODE = ("fla.ops.kda", "fla.modules.causal_conv1d.ops:causal_conv1d_update",
              "fla.modules.norm.fused_norm_gate:rms_norm_gated")

FLASHMLA_PAGE_SIZE = 64  # FlashMLA's only page size (tests/test_peers.py holds it to the op's)


def on_gpu() -> bool:
    """True where a GPU backend (ROCm or CUDA) is present, so kernels run compiled; False on a CPU, where
    Triton runs in its interpreter."""
    return env.detect().backend != "cpu"


def fla_status(needs: tuple[str, ...] = FLA_CHUNK) -> tuple[bool, str]:
    """(usable, why) for fla-core as a peer: a GPU (fla's KDA kernels are Triton kernels for GPUs) and every
    entry of `needs` importable ('module' or 'module:attribute'). ValueError for an empty or malformed
    `needs`."""
    if not needs or not all(isinstance(n, str) and n.startswith("fla") for n in needs):
        raise ValueError(f"needs must be a non-empty tuple of 'fla...' module names, got {needs!r}")
    if not on_gpu():
        return False, "fla-core runs on a GPU only (none here): no fla peer"
    for need in needs:
        module, _, attr = need.partition(":")
        try:
            loaded = importlib.import_module(module)
            if attr:
                getattr(loaded, attr)
        except Exception as exc:  # noqa: BLE001 - absent or broken: no peer, said so
            return False, f"fla-core not usable here ({need}: {type(exc).__name__}: {exc}); no fla peer"
    version = getattr(importlib.import_module("fla"), "__version__", "?")
    return True, f"fla-core {version}"


def flashmla_status(page_size: int | None = None) -> tuple[bool, str]:
    """(usable, why) for FlashMLA's dense decode as a peer of a study whose paged cache has `page_size`
    rows per page (None: the study takes FlashMLA's own page size): the op's status
    (`k3lab.ops.mla_decode.peers.flashmla_status`) once the page sizes agree."""
    if page_size is not None and page_size != FLASHMLA_PAGE_SIZE:
        return False, (f"the study's pages are {page_size} rows, FlashMLA's {FLASHMLA_PAGE_SIZE}: the MLA "
                       "study runs without the FlashMLA peer")
    return _mla().flashmla_status()


def flashmla_plan(q, pool, lengths, *, block_table, scale=None):
    """FlashMLA's decode bound once to one input set (`k3lab.ops.mla_decode.peers.flashmla_plan`): a
    callable returning (o, lse). Call only where `flashmla_status()` says usable."""
    return _mla().flashmla_plan(q, pool, lengths, block_table=block_table, scale=scale)


def fetch_flashmla():
    """Download the pinned FlashMLA library (`k3lab.ops.mla_decode.peers.fetch`) and return its path."""
    return _mla().fetch()


def aiter_status() -> tuple[bool, str]:
    """(usable, why) for AITER's MLA decode (`k3lab.ops.mla_decode.peers.aiter_status`)."""
    return _mla().aiter_status()


def _mla():
    # imported when asked: the MLA op's kernels cost nothing to a study that needs no MLA peer
    from k3lab.ops.mla_decode import peers

    return peers
