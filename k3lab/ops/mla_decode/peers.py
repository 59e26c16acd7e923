"""Peers of the MLA decode, for checks and comparisons: the fp32 reference, plain PyTorch (einsum and
SDPA), FlashMLA's dense decode (DeepSeek's Hopper kernel) from a prebuilt library, and AITER's
padded decode on ROCm. Every function returns (o [B, Tq, H, 512], lse [B, Tq, H] natural log) like
the kernels (SDPA and AITER: lse None).

FlashMLA: nothing of its source is in this project. The library is the one vLLM ships
(`vllm/_flashmla_C.abi3.so`, 1.7 MB, from the vllm 0.24.0 wheel on PyPI, built against torch 2.11
and CUDA 13): small enough to carry to a GPU machine with no network, and no build. `fetch()` (or
`python -m k3lab.ops.mla_decode.peers fetch`) downloads that wheel once and keeps the one file in
`.cache/peers/`; where vLLM itself is installed its own copy is used instead. FlashMLA packs the
query heads of a request into rows of a 64-row tile (it pads, too, inside the kernel), cuts each
request's history into pieces over the SMs from a scheduling table it computes on the GPU, and
merges them with a second kernel. It needs an sm_90a GPU, bf16 or fp16, and pages of exactly 64
rows. `flashmla_plan()` computes the scheduling table once, at plan time, so that the returned
callable launches two kernels with no host sync (CUDA-graph capturable).

AITER (`aiter_decode`): the seed's adapter, not yet run on AMD hardware by this project. It gives no
lse (`AITER_LSE`); `require_lse` refuses it by name for callers that merge partials by lse (DCP).

`flashmla_status()` / `aiter_status()` say whether each runs here and, when not, why; that is not an
error: the MLA study then leaves the peer out and says so.
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import torch

from k3lab import env
from k3lab.nn.mla import latent_attention
from k3lab.ops import expect, setting
from k3lab.ops.mla_decode.inputs import DEFAULT_SCALE, LATENT_DIM, MMA_ROWS, VALUE_DIM, gather_paged, validate

def reference(q, cache, lengths=None, *, block_table=None, scale=None):
    """k3lab.nn.mla.latent_attention in fp32 (fp64 for fp64 inputs) on the same cache (a paged cache
    is gathered first)."""
    if block_table is not None:
        cache = gather_paged(cache, block_table)
    return latent_attention(q, cache, lengths=lengths, scale=scale, value_dim=VALUE_DIM)


# ----------------------------------------------------------------------------------------------
# plain PyTorch peers


def _visible_mask(lengths, q_len: int, L: int, device) -> torch.Tensor:
    pos = torch.arange(L, device=device)
    qpos = lengths[:, None] - q_len + torch.arange(q_len, device=device)[None, :]
    return pos[None, None, :] <= qpos[:, :, None]  # [B, Tq, L]


def einsum_decode(q, cache, lengths=None, *, scale=None):
    """Plain PyTorch decode in the inputs' dtype: einsum scores, masked softmax (fp32), einsum
    values. Contiguous cache [B, L, 576] only (gather a paged one first). Returns (o, lse)."""
    B, Tq, H, D = q.shape
    L = cache.shape[1]
    scale = DEFAULT_SCALE if scale is None else scale
    scores = torch.einsum("bthd,bld->bthl", q, cache).float() * scale
    if lengths is not None or Tq > 1:
        lens = (
            torch.full((B,), L, device=q.device)
            if lengths is None
            else torch.as_tensor(lengths, device=q.device)
        )
        vis = _visible_mask(lens, Tq, L, q.device)
        scores = scores.masked_fill(~vis[:, :, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    p = torch.exp(scores - lse[..., None]).to(cache.dtype)
    o = torch.einsum("bthl,blv->bthv", p, cache[..., :VALUE_DIM])
    return o, lse


def sdpa_decode(q, cache, lengths=None, *, scale=None):
    """torch.nn.functional.scaled_dot_product_attention on the same latent cache: keys the whole row,
    values its first 512 columns, one KV head shared by all query heads (enable_gqa). SDPA returns
    no log-sum-exp: lse is None. Contiguous cache only."""
    B, Tq, H, D = q.shape
    L = cache.shape[1]
    scale = DEFAULT_SCALE if scale is None else scale
    mask = None
    if lengths is not None or Tq > 1:
        lens = (
            torch.full((B,), L, device=q.device)
            if lengths is None
            else torch.as_tensor(lengths, device=q.device)
        )
        mask = _visible_mask(lens, Tq, L, q.device)[:, None]  # [B, 1, Tq, L]
    k = cache[:, None]  # [B, 1, L, 576]
    v = cache[:, None, :, :VALUE_DIM]
    o = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask, scale=scale,
                                                         enable_gqa=True)
    return o.transpose(1, 2), None


# ----------------------------------------------------------------------------------------------
# AITER (ROCm): not yet run on AMD hardware by this project


AITER_LSE = ("AITER's mla_decode_fwd (amd-aiter 0.1.7.post2.dev18) returns (logits, final_lse), and only "
             "mla_reduce_v1 on its persistent path (a work list, work_meta_data) writes final_lse; k3lab's "
             "call passes no work list, so that tensor is never written and k3lab's AITER path has no lse")


def require_lse(backend: str, caller: str) -> None:
    """ValueError naming `backend` when its decode gives no log-sum-exp and `caller` (what merges partial
    attention by lse, e.g. "DCP") needs one: 'aiter' (AITER_LSE). Call before any kernel runs."""
    if backend == "aiter":
        raise ValueError(f"{caller} merges partial attention by its log-sum-exp, and backend 'aiter' gives "
                         f"none ({AITER_LSE}); use backend 'triton' or 'cuda'")


def aiter_status() -> tuple[bool, str]:
    """(usable, why): AITER's MLA decode needs a ROCm torch with a device and the amd-aiter package."""
    info = env.detect()
    if info.backend != "rocm":
        return False, f"backend is {info.backend}, AITER runs on ROCm only: k3lab's own kernel is used"
    if importlib.util.find_spec("aiter") is None:
        return False, "aiter is not installed (amd-aiter for this ROCm): k3lab's own kernel is used"
    try:
        from aiter import mla as _mla  # noqa: F401
    except Exception as exc:  # a broken install is reported, not fatal
        return False, f"aiter.mla failed to import ({type(exc).__name__}: {exc}): k3lab's own kernel is used"
    return True, "aiter.mla.mla_decode_fwd (not yet run on AMD hardware by this project)"


def aiter_decode(q, cache, lengths=None, *, block_table=None, scale=None):
    """AITER's padded 16-head assembly decode, called the way the seed's adapter does (vLLM PR 50578):
    copy the real heads into a 16-head query, run aiter.mla.mla_decode_fwd, drop the extra heads.

    NOT YET RUN ON AMD HARDWARE BY THIS PROJECT. The cache is described to AITER token by token
    (page_size 1: kv_indices lists each position's row in the pool), the layout every AITER version
    accepts. Returns (o, None): no lse (AITER_LSE; the second value AITER returns is not read)."""
    ok, why = aiter_status()
    if not ok:
        raise RuntimeError(f"aiter_decode unavailable: {why}")
    from aiter import mla as aiter_mla

    inp = validate(q, cache, lengths, block_table, max_heads=MMA_ROWS)
    B, Tq, H = inp.batch, inp.q_len, inp.heads
    dev = q.device
    q16 = torch.zeros(B, Tq, MMA_ROWS, LATENT_DIM, dtype=q.dtype, device=dev)
    q16[:, :, :H] = q
    lens = torch.tensor(inp.lengths_host, device=dev, dtype=torch.int64)
    if inp.paged:
        ps = inp.page_size
        idx = [inp.block_table[b, torch.arange(n, device=dev) // ps].long() * ps + torch.arange(n, device=dev)
               % ps
               for b, n in enumerate(inp.lengths_host)]
        kv_rows = cache.reshape(-1, 1, 1, LATENT_DIM)
    else:
        L = cache.shape[1]
        idx = [b * L + torch.arange(n, device=dev) for b, n in enumerate(inp.lengths_host)]
        kv_rows = cache.reshape(B * L, 1, 1, LATENT_DIM)
    kv_indices = torch.cat(idx).to(torch.int32)
    kv_indptr = torch.zeros(B + 1, dtype=torch.int32, device=dev)
    kv_indptr[1:] = torch.cumsum(lens, 0).to(torch.int32)
    qo_indptr = torch.arange(0, (B + 1) * Tq, Tq, dtype=torch.int32, device=dev)
    last_page = torch.ones(B, dtype=torch.int32, device=dev)
    o16 = torch.empty(B * Tq, MMA_ROWS, VALUE_DIM, dtype=q.dtype, device=dev)
    kwargs = dict(sm_scale=DEFAULT_SCALE if scale is None else float(scale))
    params = inspect.signature(aiter_mla.mla_decode_fwd).parameters
    if "page_size" in params:  # versions that take the page size by name
        kwargs["page_size"] = 1
    aiter_mla.mla_decode_fwd(q16.view(B * Tq, MMA_ROWS, LATENT_DIM), kv_rows, o16, qo_indptr, kv_indptr,
                             # writes o16; its final_lse is never written
                             kv_indices, last_page, Tq, **kwargs)
    return o16.view(B, Tq, MMA_ROWS, VALUE_DIM)[:, :, :H].contiguous(), None


class AiterPlan:
    """`aiter_decode` on fixed inputs, as the 'aiter' backend of plan_after (validated at each call:
    AITER builds its index lists on the host); `plan()` returns (o, None). Not yet run on AMD hardware
    by this project."""

    variant = "after"
    backend = "aiter"
    pad = "copy"
    returns_lse = False

    def __init__(self, q, cache, lengths=None, *, block_table=None, scale=None):
        validate(q, cache, lengths, block_table, max_heads=MMA_ROWS)  # bad input: refused now, by name
        self._call = (q, cache, lengths, block_table, scale)

    def facts(self) -> dict:
        return {"backend": "aiter", "pad": "copy", "lse": False}

    def __call__(self):
        q, cache, lengths, block_table, scale = self._call
        return aiter_decode(q, cache, lengths, block_table=block_table, scale=scale)

# ----------------------------------------------------------------------------------------------
# FlashMLA (NVIDIA sm_90a), from vLLM's prebuilt library

# Where the library comes from, and the file's digest: a different file is refused.
WHEEL = "vllm==0.24.0"
WHEEL_FILE = "vllm-0.24.0-cp38-abi3-manylinux_2_28_x86_64.whl"
# The wheel's sha256 (as PyPI publishes it; pip checked it on download) and the library's inside it.
WHEEL_SHA256 = "2d2831aeba311292250df0132dbc4d8e9f42c654536eaec48e6fe58acb1822cf"
MEMBER = "vllm/_flashmla_C.abi3.so"
SHA256 = "7d55be379e446ca10ca256cb14ebed974d59ef1b7d905f7552414b846f7b3a91"
TORCH_BUILT_FOR = ("2.11", "13")  # torch release and CUDA major the file was linked against
FLASHMLA_PAGE_SIZE = 64  # FlashMLA's only page size
LIB_ENV = "K3LAB_FLASHMLA_LIB"
_ROOT = Path(__file__).resolve().parents[3]
DEFAULT_PATH = _ROOT / ".cache" / "peers" / "_flashmla_C.abi3.so"

_loaded: dict[str, str] = {}  # path -> "" once loaded, or the loading error


def library_path() -> tuple[Path | None, str]:
    """(path, where it came from): K3LAB_FLASHMLA_LIB, an installed vLLM's copy, or the fetched file."""
    if setting(LIB_ENV):
        return Path(setting(LIB_ENV)), f"${LIB_ENV}"
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


def flashmla_status() -> tuple[bool, str]:
    """(usable, why). Usable needs an sm_90 GPU, the library, and (for the fetched file) the torch it
    was built against; each missing piece is named, with what is used instead."""
    instead = "the MLA study runs without the FlashMLA peer"
    if not torch.cuda.is_available() or torch.version.hip is not None:
        return False, f"FlashMLA needs an NVIDIA GPU (found none): {instead}"
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) != (9, 0):
        return (
            False,
            f"FlashMLA's dense decode needs sm_90a (Hopper); this GPU is sm_{major}{minor}: {instead}",
        )
    path, origin = library_path()
    if path is None:
        return False, (f"no FlashMLA library (set {LIB_ENV}, install vllm, or run "
                       f"`python -m k3lab.ops.mla_decode.peers fetch`): {instead}")
    if origin.startswith("fetched"):
        built, cuda = TORCH_BUILT_FOR
        if not torch.__version__.startswith(built + ".") or not str(torch.version.cuda or "").startswith(
            cuda + "."
        ):
            return False, (f"the fetched FlashMLA library was built for torch {built} + CUDA {cuda}, this is "
                           f"torch {torch.__version__} + CUDA {torch.version.cuda}: {instead}")
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
        except Exception as exc:  # a mismatched library is reported by flashmla_status(), not raised
            _loaded[key] = f"{type(exc).__name__}: {exc}".splitlines()[0]
    return _loaded[key]


def flashmla_check(q, pool, lengths, block_table) -> None:
    """FlashMLA's own limits, as clear errors before any launch (the shared checks are inputs.validate's)."""
    expect("pool", pool, shape=(None, FLASHMLA_PAGE_SIZE, None),
           what=f"[num_pages, {FLASHMLA_PAGE_SIZE}, {LATENT_DIM}] (FlashMLA's paged pool)")
    if block_table is None or lengths is None:
        raise ValueError("FlashMLA needs block_table= and lengths= (a paged cache)")
    expect("q", q, dtype=(torch.bfloat16, torch.float16))  # FlashMLA's input dtypes


def flashmla_plan(q, pool, lengths, *, block_table, scale=None):
    """A callable returning (o [B, Tq, H, 512], lse [B, Tq, H], natural log) for these inputs; q_len > 1
    is causal inside the group, as in mla_decode. The scheduling table is computed here, once."""
    ok, why = flashmla_status()
    if not ok:
        raise RuntimeError(f"FlashMLA unavailable: {why}")
    flashmla_check(q, pool, lengths, block_table)
    inp = validate(q, pool, lengths, block_table)
    scale = DEFAULT_SCALE if scale is None else float(scale)
    qc = q.contiguous()
    kc = pool.unsqueeze(2)  # [num_pages, 64, 1 KV head, 576]
    lens, table = inp.lengths, inp.block_table
    causal = inp.q_len > 1
    op = torch.ops._flashmla_C.dense_decode_fwd
    _, _, meta, splits = op(qc, kc, VALUE_DIM, lens, table, scale, causal, None, None, None)

    def run():
        o, lse, _, _ = op(qc, kc, VALUE_DIM, lens, table, scale, causal, meta, splits, None)
        return o, lse.transpose(1, 2)  # FlashMLA's lse is [B, H, Tq]

    return run


def fetch(dest: Path = DEFAULT_PATH) -> Path:
    """Download the one vLLM wheel (WHEEL_FILE: a built wheel only, never a source build, which would
    run the package's code; no dependencies; pinned by WHEEL_SHA256 through pip's hash-checking mode)
    into a temporary folder and keep the one library, itself checked against SHA256. The library is
    written to a temp file and renamed, so `dest` is either absent or the right file."""
    if dest.is_file() and _digest(dest) == SHA256:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        req = Path(tmp) / "requirements.txt"
        req.write_text(f"{WHEEL} --hash=sha256:{WHEEL_SHA256}\n")
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        "--require-hashes", "--dest", str(Path(tmp) / "dl"), "-r", str(req)], check=True)
        wheel = Path(tmp) / "dl" / WHEEL_FILE
        if not wheel.is_file() or _digest(wheel) != WHEEL_SHA256:
            got = sorted(p.name for p in (Path(tmp) / "dl").glob("*"))
            raise RuntimeError(f"pip did not bring {WHEEL_FILE} with sha256 {WHEEL_SHA256} (got {got}); "
                               "this library exists for Linux x86_64 only")
        part = dest.with_name(dest.name + ".part")
        with zipfile.ZipFile(wheel) as zf, zf.open(MEMBER) as src, open(part, "wb") as out:
            shutil.copyfileobj(src, out)
        if _digest(part) != SHA256:
            part.unlink()
            raise RuntimeError(f"{MEMBER} from {WHEEL_FILE} has an unexpected sha256; removed")
        os.replace(part, dest)
    return dest


def main(argv: list[str]) -> int:
    """`python -m k3lab.ops.mla_decode.peers fetch|status`: fetch the FlashMLA library, or say whether it
    runs."""
    if argv == ["fetch"]:
        print(fetch())
    elif argv == ["status"]:
        print(flashmla_status())
    else:
        print("usage: python -m k3lab.ops.mla_decode.peers fetch|status", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
