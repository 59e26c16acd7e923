"""What a precision costs in the step's answers: the decode step (`DecodeStep`) at each precision
(`switches.PRECISIONS`: 'bf16', 'fp8', 'article') against the same step at 'bf16'.

    rows = greedy_cost(K3Config.tiny(), steps=64)     # the tiny model's greedy decode, one row a precision
    rows = step_cost()                                # one step at TP8 slice shapes on random weights

`greedy_cost`: a K3Model with `init_weights(seed)` prefills a random prompt (in the model's dtype, the
same cache for every precision); then `steps` decode steps run through DecodeStep with the model's
weights, each step a DecodeStep of the grown context that loads the previous step's caches (its own
precision's: an FP8 step keeps reading what the FP8 step wrote). The 'bf16' reference decodes greedily;
every precision, 'bf16' itself again (run-to-run: it must give 0), is fed the reference's tokens
(teacher forcing), so its logits at step t follow the same tokens as the reference's. A row says:
tokens_match, the steps whose greedy choice (argmax) equals the reference's token; first_divergence,
the first step where it does not (None: never), which is where a free-running greedy decode at that
precision would first leave the reference's text; max_abs_logit, the largest |logit - reference
logit| over every step, sequence and vocabulary entry; kl_mean, KL(reference || precision) of the
next-token distributions, in nats, mean over steps and sequences (fp64); experts_changed, the share
of (step, MoE layer, token) whose routed experts differ from the reference's: a router near a tie
flips its choice under a small rounding, and a flipped expert moves that layer's output by O(1).

`step_cost`: one step of one rank at TP8 slice shapes (K3's widths; 2 layers, one KDA and one MLA, 16
experts and a 65,536-token vocabulary so the weights fit a CPU's memory) on random weights from one
seed, at each precision against 'bf16'; collectives are stand-ins (the rank's own bytes), so these
logits are one rank's arithmetic, not the model's. K3-wide, it holds GBs of weights a precision.

On a CPU the step runs in fp32 (Triton's interpreter multiplies bf16 tiles wrongly), so 'bf16' there
means the weights' dtype, fp32: the rows say which dtype ran (its projections are the step's default
there, the matrix library: `k3lab.engine.rows.default_projections`). A
precision the step refuses here (its ValueError when built, e.g. precision='article' before the step ran
the article's formats) gives a row with status 'not available' and the step's reason, not an error. Bad
arguments raise ValueError / TypeError naming the argument before anything runs.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from k3lab.config import K3Config

from .step import DecodeStep
from .switches import PRECISIONS, SWITCHES
from .weights import RankWeights

REFERENCE = "bf16"
MAX_STEPS = 512
# On a CPU every Triton kernel runs in the interpreter, where the grouped experts cost about 20 s a step
# on 2 cores; the fused KDA decode is the cheapest form there. Every switch computes the same result in
# fp32 (tests/test_step.py), so a precision's cost does not depend on which are on.
CPU_OPTIMIZATIONS = frozenset({"kda_fused"})
# What a missing figure of a row means, for tables (`k3lab.plots.say_missing`): a row that ran and never
# left bf16's greedy path has no first divergence; a precision not available here has no figures; a run
# whose routed experts were not recorded has no share of changed choices.
MISSING = {"first_divergence": "never", "tokens_match": "not run", "max_abs_logit": "not run",
           "ref_abs_max": "not run", "kl_mean": "not run", "experts_changed": "not recorded"}


def _int(name: str, value, lo: int, hi: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise ValueError(f"{name} must be an integer in [{lo}, {hi}], got {value!r}")
    return value


def _precisions(precisions) -> tuple[str, ...]:
    if isinstance(precisions, str) or not isinstance(precisions, (tuple, list)):
        raise TypeError(f"precisions must be a tuple or list of names from {PRECISIONS}, got "
                        f"{type(precisions).__name__}")
    bad = [p for p in precisions if p not in PRECISIONS]
    if bad or not precisions or len(set(precisions)) != len(precisions):
        raise ValueError(f"precisions must be distinct names from {PRECISIONS}, at least one, got "
                         f"{list(precisions)!r}")
    return tuple(precisions)


def _device(device) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be a torch device or its name ('cpu', 'cuda'), got {device!r}") \
            from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device is 'cuda' but no CUDA GPU is present")
    return dev


def _optimizations(optimizations, dev: torch.device):
    if optimizations is None:
        return "all" if dev.type == "cuda" else set(CPU_OPTIMIZATIONS)
    if isinstance(optimizations, (set, frozenset)):
        unknown = sorted(set(optimizations) - set(SWITCHES))
        if unknown:
            raise ValueError(f"optimizations names unknown switches {unknown}; known: {sorted(SWITCHES)}")
        return set(optimizations)
    if optimizations in ("all", "none"):
        return optimizations
    raise ValueError(f"optimizations must be None, 'all', 'none' or a set of switch names, got "
                     f"{optimizations!r}")


def _row(precision: str, **kw) -> dict:
    row = {"precision": precision, "status": "ran", "dtype": "", "runs": "", "steps": 0, "tokens_match": None,
           "first_divergence": None, "max_abs_logit": math.nan, "ref_abs_max": math.nan, "kl_mean": math.nan,
           "experts_changed": math.nan, "note": ""}
    row.update(kw)
    return row


def compare(logits: torch.Tensor, ref: torch.Tensor, ref_tokens: torch.Tensor, routes=None,
            ref_routes=None) -> dict:
    """Figures of logits [S, B, V] against the reference's [S, B, V] and its tokens [S, B] (what each step
    fed next): tokens_match, first_divergence, max_abs_logit, kl_mean (module docstring) and ref_abs_max
    (the reference's largest |logit|, the scale max_abs_logit is read against), in fp64; with the routed
    experts each MoE layer chose ([S, layers, tokens, top_k], sorted) of both, experts_changed: the share
    of (step, layer, token) whose chosen set differs from the reference's (NaN without them)."""
    if logits.shape != ref.shape or ref_tokens.shape != ref.shape[:2]:
        raise ValueError(f"logits {tuple(logits.shape)}, ref {tuple(ref.shape)} and ref_tokens "
                         f"{tuple(ref_tokens.shape)} must be [S, B, V], [S, B, V] and [S, B]")
    lp, lr = logits.double(), ref.double()
    same = (lp.argmax(-1) == ref_tokens).all(-1)          # [S]: every sequence chose the reference's token
    wrong = (~same).nonzero()
    log_p, log_r = torch.log_softmax(lp, -1), torch.log_softmax(lr, -1)
    kl = (log_r.exp() * (log_r - log_p)).sum(-1)          # [S, B]
    return {"steps": int(lp.shape[0]), "tokens_match": int(same.sum()),
            "first_divergence": int(wrong[0]) if len(wrong) else None,
            "max_abs_logit": float((lp - lr).abs().max()), "ref_abs_max": float(lr.abs().max()),
            "kl_mean": float(kl.mean()),
            "experts_changed": (math.nan if routes is None or ref_routes is None or routes.numel() == 0 else
                                float((routes != ref_routes).any(-1).double().mean()))}


def _refused(build) -> str:
    """'' where `build()` (a DecodeStep at some precision) is accepted here, else the step's own reason
    (its ValueError): a precision the step does not run here is a row that says so, not an error. Only
    building is guarded: an error while a built step runs is raised."""
    try:
        build()
    except ValueError as err:
        return str(err)
    return ""


def _runs(step: DecodeStep) -> str:
    """What the step ran in: its projections, MLA decode and routed experts' forms."""
    r = step.resolved
    return (f"projections={r.projections}, mla={r.impl.get('mla_padded')}, "
            f"experts={r.impl.get('grouped_experts')}")


def _routes(step: DecodeStep) -> torch.Tensor:
    """The experts each MoE layer of the step's last run chose: [layers, tokens, top_k], sorted, CPU."""
    if not step.routes:
        return torch.zeros(0, step.tokens, step.config.num_experts_per_token, dtype=torch.long)
    return torch.stack([r.reshape(step.tokens, -1).sort(-1).values.cpu() for r in step.routes])


def _cache_after(step: DecodeStep):
    """The K3Cache of context_len + 1 positions that `step` leaves (its own caches after one decode)."""
    from k3lab.model import K3Cache
    from k3lab.nn import KDACache
    from k3lab.nn.mla import MLACache

    got = step.cache_entries()
    n = step.context_len + step.q_len
    layers = []
    for i in range(step.config.num_hidden_layers):
        if f"layers.{i}.latent" in got:
            layers.append(MLACache(got[f"layers.{i}.latent"][:, :n].clone()))
        else:
            layers.append(KDACache(*(got[f"layers.{i}.{k}"].clone() for k in ("conv_q", "conv_k", "conv_v",
                                                                                 "state"))))
    return K3Cache(layers, got["attn_res.blocks"].clone(), got["attn_res.partial"].clone(), n)


def _decode(weights: RankWeights, cache, first: torch.Tensor, steps: int, precision: str, optimizations,
            forced: torch.Tensor | None):
    """`steps` decode steps from `cache` (first token ids [B, 1]): (logits [S, B, V] fp64 on the CPU,
    tokens [S, B] chosen greedily, what ran, the routed experts [S, MoE layers, B, top_k] each step chose,
    sorted). forced [S, B]: feed these tokens instead of the greedy ones. The first step converts the
    weights to the precision's formats; the later steps take its converted weights.

    An FP8 latent cache (precision='article') takes its per-layer scale from the history it loads (twice
    its largest magnitude: `step.KV_HEADROOM`), so the values one step leaves re-quantize to the same codes
    in the next while that scale holds; where a new row passes the history's largest value a step sets
    a larger one (a server would keep its scale and clamp) and `runs` says at which step."""
    ids, out, toks, runs, scales, moved, routes = first, [], [], "", None, None, []
    for t in range(steps):
        step = DecodeStep(weights.config, first.shape[0], cache.length, weights=weights,
                          optimizations=optimizations, precision=precision)
        weights = step.weights
        step.load_cache(cache)
        now = {i: float(v) for i, v in getattr(step, "kv_scales", {}).items()}
        if scales is not None and now != scales and moved is None:
            moved = t
        scales = now
        step.routes = []
        with torch.no_grad():
            logits = step(ids)[:, -1].double().cpu()
        routes.append(_routes(step))
        out.append(logits)
        toks.append(logits.argmax(-1))
        runs = runs or _runs(step)
        nxt = forced[t] if forced is not None else toks[-1]
        ids = nxt.view(-1, 1).to(first.device)
        cache = _cache_after(step)
    if moved is not None:
        runs += f"; the FP8 cache's scale was set again at step {moved}"
    return torch.stack(out), torch.stack(toks), runs, torch.stack(routes)


def greedy_cost(config: K3Config | None = None, *, steps: int = 64, prompt_len: int = 8, batch: int = 1,
                precisions=PRECISIONS, seed: int = 0, device=None, optimizations=None) -> list[dict]:
    """The tiny model's greedy decode at each precision against 'bf16' (module docstring): one dict a
    precision with precision, status ('ran' / 'not available'), dtype, runs (the step's projections, MLA
    decode and experts forms), steps, tokens_match, first_divergence, max_abs_logit, ref_abs_max, kl_mean,
    experts_changed, note.

    config: a whole model's config (tp_size 1; default K3Config.tiny()); steps: decode steps (1..512);
    prompt_len, batch: the random prompt; device: default the GPU if there is one (bf16), else the CPU
    (fp32); optimizations: the step's switches (default 'all' on a GPU, `CPU_OPTIMIZATIONS` on a CPU)."""
    from k3lab.model import K3Model, init_weights

    config = K3Config.tiny() if config is None else config
    if not isinstance(config, K3Config) or config.tp_size != 1:
        raise ValueError(f"config must be a whole model's K3Config (tp_size 1), got {config!r:.80}")
    _int("steps", steps, 1, MAX_STEPS)
    _int("prompt_len", prompt_len, 1, 4096)
    _int("batch", batch, 1, 64)
    _int("seed", seed, 0, 2 ** 31 - 1)
    wanted = _precisions(precisions)
    dev = _device(device)
    opt = _optimizations(optimizations, dev)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    model = init_weights(K3Model(config, device=dev, dtype=dtype), seed, on_device=dev.type == "cuda").eval()
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, config.vocab_size, (batch, prompt_len + 1), generator=gen).to(dev)
    with torch.no_grad():
        _, cache = model.prefill(prompt[:, :-1])
    weights = RankWeights.from_model(model, 1, 0)
    first = prompt[:, -1:]
    ref, ref_tokens, _, ref_routes = _decode(weights, cache, first, steps, REFERENCE, opt, None)
    rows = []
    for p in wanted:
        why = _refused(lambda: DecodeStep(config, batch, cache.length, weights=weights, optimizations=opt,
                                          precision=p))
        if why:
            rows.append(_row(p, status="not available", dtype=str(dtype).replace("torch.", ""), note=why))
            continue
        logits, _, runs, routes = _decode(weights, cache, first, steps, p, opt, ref_tokens)
        note = "a second run of the reference (run to run)" if p == REFERENCE else ""
        rows.append(_row(p, dtype=str(dtype).replace("torch.", ""), runs=runs, note=note,
                         **compare(logits, ref, ref_tokens, routes, ref_routes)))
    return rows


def tp8_config(layers: int = 2) -> K3Config:
    """One TP8 rank's slice at K3's widths, reduced in depth (`layers`: KDA first, the last one MLA), to
    16 experts (top 4) and a 65,536-token vocabulary (8,192 a rank): `step_cost`'s default."""
    _int("layers", layers, 2, K3Config.full().num_hidden_layers)
    return dataclasses.replace(K3Config.full(), num_hidden_layers=layers, num_experts=16,
                               num_experts_per_token=4, vocab_size=65536, name=f"k3-{layers}layers").sliced(8)


def step_cost(config: K3Config | None = None, *, context_len: int = 64, precisions=PRECISIONS, seed: int = 0,
              device=None, optimizations=None) -> list[dict]:
    """One decode step of one rank (config: a TP slice, default `tp8_config()`) on random weights from
    `seed`, at each precision against 'bf16': rows as `greedy_cost`'s with steps = 1 (tokens_match: 1
    where every sequence's argmax agrees). Each precision builds its step from the same seed, so the
    weights before quantization and the caches are the same."""
    config = tp8_config() if config is None else config
    if not isinstance(config, K3Config):
        raise ValueError(f"config must be a K3Config (a TP slice), got {type(config).__name__}")  # noqa: TRY004
    _int("context_len", context_len, 1, 1 << 20)
    _int("seed", seed, 0, 2 ** 31 - 1)
    wanted = _precisions(precisions)
    dev = _device(device)
    opt = _optimizations(optimizations, dev)
    ids = torch.randint(0, config.vocab_size, (1, 1), generator=torch.Generator().manual_seed(seed)).to(dev)

    def build(p):
        return DecodeStep(config, 1, context_len, weights="random", distinct_layers=1, seed=seed, device=dev,
                          optimizations=opt, precision=p)

    def one(step):
        step.routes = []
        with torch.no_grad():
            logits = step(ids)[:, -1].double().cpu()
        return logits[None], str(step.dtype).replace("torch.", ""), _runs(step), _routes(step)[None]

    ref, dtype, _, ref_routes = one(build(REFERENCE))
    ref_tokens = ref.argmax(-1)
    rows = []
    for p in wanted:
        built = []  # each precision's step is built once: refused here, or run below
        why = _refused(lambda: built.append(build(p)))
        if why:
            rows.append(_row(p, status="not available", dtype=dtype, note=why))
            continue
        logits, dtype, runs, routes = one(built.pop())
        rows.append(_row(p, dtype=dtype, runs=runs, **compare(logits, ref, ref_tokens, routes, ref_routes)))
    return rows


__all__ = ["CPU_OPTIMIZATIONS", "REFERENCE", "compare", "greedy_cost",
           "step_cost", "tp8_config"]
