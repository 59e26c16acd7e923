"""FlashMLA's dense decode (DeepSeek's Hopper MLA kernel) as a peer of the MLA decode, run from a
prebuilt library: nothing of FlashMLA's source is in this project.

The library is the one vLLM ships (`vllm/_flashmla_C.abi3.so`, 1.7 MB, from the vllm 0.24.0 wheel on
PyPI, built against torch 2.11 and CUDA 13): small enough to carry to a GPU machine with no network,
and no build. `fetch()` (or `python -m k3lab.ops.flashmla_peer fetch`) downloads that wheel once and
keeps the one file in `.cache/peers/`. Where vLLM itself is installed its own copy is used instead.

FlashMLA packs the query heads of a request into rows of a 64-row tile (12 heads fill 12 of the 64
rows: it pads, too, inside the kernel), cuts each request's history into pieces over the SMs from a
scheduling table it computes on the GPU, and merges them with a second kernel. It needs an sm_90a GPU,
bf16 or fp16, and pages of exactly 64 rows. `plan()` computes the scheduling table once, at plan time,
so that the returned callable launches two kernels with no host sync (CUDA-graph capturable).

`status()` says whether it runs here and, when not, why; that is not an error: the MLA study then
leaves the peer out and says so.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import torch

from k3lab.ops import mla_decode as mla

# Where the library comes from, and the file's digest: a different file is refused.
WHEEL = "vllm==0.24.0"
MEMBER = "vllm/_flashmla_C.abi3.so"
SHA256 = "7d55be379e446ca10ca256cb14ebed974d59ef1b7d905f7552414b846f7b3a91"
TORCH_BUILT_FOR = ("2.11", "13")  # torch release and CUDA major the file was linked against
PAGE_SIZE = 64  # FlashMLA's only page size
LIB_ENV = "K3LAB_FLASHMLA_LIB"
_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_PATH = _ROOT / ".cache" / "peers" / "_flashmla_C.abi3.so"

_loaded: dict[str, str] = {}  # path -> "" once loaded, or the loading error


def library_path() -> tuple[Path | None, str]:
    """(path, where it came from): K3LAB_FLASHMLA_LIB, an installed vLLM's copy, or the fetched file."""
    if os.environ.get(LIB_ENV):
        return Path(os.environ[LIB_ENV]), f"${LIB_ENV}"
    spec = importlib.util.find_spec("vllm")
    if spec is not None and spec.submodule_search_locations:
        for folder in spec.submodule_search_locations:
            candidate = Path(folder) / "_flashmla_C.abi3.so"
            if candidate.is_file():
                return candidate, "the installed vllm"
    if DEFAULT_PATH.is_file():
        return DEFAULT_PATH, f"fetched ({WHEEL})"
    return None, "not found"


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def status() -> tuple[bool, str]:
    """(usable, why). Usable needs an sm_90 GPU, the library, and (for the fetched file) the torch it
    was built against; each missing piece is named, with what is used instead."""
    instead = "the MLA study runs without the FlashMLA peer"
    if not torch.cuda.is_available() or torch.version.hip is not None:
        return False, f"FlashMLA needs an NVIDIA GPU (found none): {instead}"
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) != (9, 0):
        return False, f"FlashMLA's dense decode needs sm_90a (Hopper); this GPU is sm_{major}{minor}: {instead}"
    path, origin = library_path()
    if path is None:
        return False, (f"no FlashMLA library (set {LIB_ENV}, install vllm, or run "
                       f"`python -m k3lab.ops.flashmla_peer fetch`): {instead}")
    if origin.startswith("fetched"):
        built, cuda = TORCH_BUILT_FOR
        if not torch.__version__.startswith(built + ".") or not str(torch.version.cuda or "").startswith(cuda + "."):
            return False, (f"the fetched FlashMLA library was built for torch {built} + CUDA {cuda}, this is torch "
                           f"{torch.__version__} + CUDA {torch.version.cuda}: {instead}")
        if _digest(path) != SHA256:
            return False, f"{path} is not the file of {WHEEL} (sha256 differs): {instead}"
    err = _load(path)
    if err:
        return False, f"loading {path} failed ({err}): {instead}"
    return True, f"FlashMLA dense decode from {origin} ({path.name})"


def _load(path: Path) -> str:
    key = str(path)
    if key not in _loaded:
        try:
            torch.ops.load_library(key)
            torch.ops._flashmla_C.dense_decode_fwd  # noqa: B018 - the op must be registered
            _loaded[key] = ""
        except Exception as exc:  # a mismatched library is reported by status(), not raised
            _loaded[key] = f"{type(exc).__name__}: {exc}".splitlines()[0]
    return _loaded[key]


def check_inputs(q, pool, lengths, block_table) -> None:
    """FlashMLA's own limits, as clear errors before any launch (the shared checks are mla_decode's)."""
    if not isinstance(pool, torch.Tensor) or pool.dim() != 3 or pool.shape[1] != PAGE_SIZE:
        raise ValueError(f"FlashMLA needs a paged pool [num_pages, {PAGE_SIZE}, {mla.LATENT_DIM}], got "
                         f"{tuple(pool.shape) if isinstance(pool, torch.Tensor) else type(pool).__name__}")
    if block_table is None or lengths is None:
        raise ValueError("FlashMLA needs block_table= and lengths= (a paged cache)")
    if q.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"FlashMLA needs bf16 or fp16 inputs, got q.dtype {q.dtype}")


def plan(q, pool, lengths, *, block_table, scale=None):
    """A callable returning (o [B, Tq, H, 512], lse [B, Tq, H], natural log) for these inputs; q_len > 1
    is causal inside the group, as in mla_decode. The scheduling table is computed here, once."""
    ok, why = status()
    if not ok:
        raise RuntimeError(f"FlashMLA unavailable: {why}")
    check_inputs(q, pool, lengths, block_table)
    inp = mla._validate(q, pool, lengths, block_table)
    scale = mla.DEFAULT_SCALE if scale is None else float(scale)
    qc = q.contiguous()
    kc = pool.unsqueeze(2)  # [num_pages, 64, 1 KV head, 576]
    lens, table = inp.lengths, inp.block_table
    causal = inp.q_len > 1
    op = torch.ops._flashmla_C.dense_decode_fwd
    _, _, meta, splits = op(qc, kc, mla.VALUE_DIM, lens, table, scale, causal, None, None, None)

    def run():
        o, lse, _, _ = op(qc, kc, mla.VALUE_DIM, lens, table, scale, causal, meta, splits, None)
        return o, lse.transpose(1, 2)  # FlashMLA's lse is [B, H, Tq]

    return run


def fetch(dest: Path = DEFAULT_PATH) -> Path:
    """Download the vLLM wheel (no dependencies) into a temporary folder and keep the one library."""
    if dest.is_file() and _digest(dest) == SHA256:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--dest", tmp, WHEEL],
                       check=True)
        wheel = next(Path(tmp).glob("vllm-*.whl"))
        with zipfile.ZipFile(wheel) as zf, zf.open(MEMBER) as src, open(dest, "wb") as out:
            shutil.copyfileobj(src, out)
    if _digest(dest) != SHA256:
        dest.unlink()
        raise RuntimeError(f"{MEMBER} from {WHEEL} has an unexpected sha256; removed")
    return dest


if __name__ == "__main__":
    if sys.argv[1:] == ["fetch"]:
        print(fetch())
    elif sys.argv[1:] == ["status"]:
        print(status())
    else:
        sys.exit("usage: python -m k3lab.ops.flashmla_peer fetch|status")
