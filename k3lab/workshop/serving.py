"""Tasks of notebooks 06 (draft depth), 07 (agent cache) and 08 (the whole step): host-side
arithmetic, graded against the library functions the notebooks use: `k3lab.speculative.best_depth`,
`k3lab.cache.resume.resume_point` and `k3lab.studies.decode_step.measure.step_bytes`.
"""

from __future__ import annotations

import numpy as np

from k3lab import speculative as spec
from k3lab.cache.resume import resume_point
from k3lab.config import K3Config
from k3lab.studies.decode_step.measure import step_bytes

from ._core import EXACT, Case, Task


# ------------------------------------------------------------------------------------------ 06
def _rates(acceptance, draft_step_us, verify_us, commit_us) -> np.ndarray:
    costs = spec.CycleCosts(draft_step_us=draft_step_us, verify_us=tuple(verify_us), commit_us=commit_us)
    return spec.best_depth(acceptance, costs).table["tokens_per_s"].to_numpy()


def _depth_cases(seed: int, device) -> list[Case]:
    rng = np.random.default_rng(seed)
    kinds = ["memory-bound verify", "compute-bound verify", "slow drafter", "steep acceptance decay"]
    out: list[Case] = []
    while len(out) < 8:
        kind = kinds[len(out) % len(kinds)]
        K = int(rng.integers(5, 9))
        first = rng.uniform(0.6, 0.95)
        decay = rng.uniform(0.55, 0.75) if kind == "steep acceptance decay" else rng.uniform(0.85, 1.0)
        acc = np.clip(first * decay ** np.arange(K), 0.01, 0.99)
        one = rng.uniform(5_000, 20_000)
        per_position = {"memory-bound verify": 0.01, "compute-bound verify": 0.2}.get(kind, 0.04)
        extra = per_position * one * rng.uniform(0.5, 1.5)
        curve = rng.uniform(1.0, 1.3)  # verification grows a little faster than linearly,
        tile = int(rng.choice([3, 4, 5]))  # and steps up where the positions outgrow one tile of tokens
        step = one * (rng.uniform(0.3, 0.5) if kind == "memory-bound verify" else rng.uniform(0.05, 0.2))
        verify = [float(one + extra * (n - 1) ** curve + step * (n > tile)) for n in range(1, K + 2)]
        draft = one * (rng.uniform(0.1, 0.2) if kind == "slow drafter" else rng.uniform(0.01, 0.05))
        commit = one * rng.uniform(0.005, 0.02)
        rates = np.sort(_rates(acc, draft, verify, commit))
        if rates[-1] < rates[-2] * (1 + 1e-6):  # a near tie: the best depth would hang on rounding
            continue
        inputs = {"acceptance": acc, "draft_step_us": float(draft), "verify_us": verify,
                  "commit_us": float(commit)}
        out.append(Case(f"{kind}, {K} drafts at most", inputs, EXACT))
    return out


def _depth_reference(case: Case) -> int:
    x = case.inputs
    costs = spec.CycleCosts(draft_step_us=x["draft_step_us"], verify_us=tuple(x["verify_us"]),
                            commit_us=x["commit_us"])
    return spec.best_depth(x["acceptance"], costs).depth


def best_depth_solution(acceptance, draft_step_us, verify_us, commit_us):
    """committed(k) = 1 + a1 + a1 a2 + ... + a1...ak (the recovery or bonus token counts);
    cycle(k) = k draft steps + one verification of k + 1 positions + the commit."""
    best, best_rate = 0, -1.0
    survive, committed = 1.0, 1.0
    for k in range(1, len(acceptance) + 1):
        survive *= acceptance[k - 1]
        committed += survive
        cycle = k * draft_step_us + verify_us[k] + commit_us   # verify_us[n - 1]: n positions
        if committed / cycle > best_rate:
            best, best_rate = k, committed / cycle
    return best


DEPTH_STUB = '''\
def best_depth(acceptance, draft_step_us, verify_us, commit_us):
    """acceptance[i]: P(draft i + 1 accepted | the drafts before it were), for depths 1..K.
    verify_us[n - 1]: one target forward over n positions, n = 1..K + 1. Return the depth k in 1..K
    with the most committed tokens per microsecond."""
    # TODO: committed(k) = 1 + a1 + a1*a2 + ... + a1*...*ak
    #       cycle(k) = k * draft_step_us + (verification of k + 1 positions) + commit_us
    raise NotImplementedError("choose the depth")
'''

DEPTH = Task(
    name="draft_depth", notebook="06_draft_depth", minutes=15,
    statement="""\
**Task: choose the draft depth from a cost curve.** Write `best_depth(acceptance, draft_step_us,
verify_us, commit_us)`: for each depth `k` the expected committed tokens per cycle (the accepted drafts
plus the one recovery or bonus token) over the cycle time (k draft steps, one verification of `k + 1`
positions, the commit), and return the `k` with the highest rate. `verify_us[n - 1]` is the
verification of `n` positions; it steps up where the positions outgrow one tile of tokens. `check`
compares with `k3lab.speculative.best_depth` on eight cost curves.""",
    signature="best_depth(acceptance: ndarray[K], draft_step_us: float, verify_us: list[float] (K + 1), "
              "commit_us: float) -> int",
    outputs=("depth",), cases=_depth_cases, reference=_depth_reference, solution=best_depth_solution,
    stub=DEPTH_STUB,
    forbidden=("k3lab.speculative.costs.best_depth", "k3lab.speculative.acceptance.expected_committed_all",
               "k3lab.speculative.acceptance.expected_committed",
               "k3lab.speculative.costs.CycleCosts.cycle_us", "k3lab.speculative.costs.CycleCosts.cycle_all"),
    hints=(
        "Each depth k has a payoff, the tokens one cycle commits, and a cost, the cycle's microseconds. The "
        "best depth has the best ratio, not the most tokens.",
        "Draft i counts only if drafts 1..i were all accepted, with probability a1 a2 ... ai. Expected "
        "committed tokens at depth k = 1 + the sum of those products for i <= k (the 1 is the recovery or "
        "bonus token the target always gives). A cycle of depth k drafts k tokens, verifies k + 1 "
        "positions and commits.",
        "Start from `committed, survive = 1.0, 1.0`; for k = 1..K: `survive *= acceptance[k - 1]`, "
        "`committed += survive`, `cycle = k * draft_step_us + verify_us[k] + commit_us` (verify_us[k] is "
        "k + 1 positions); keep the k, counted from 1, with the largest committed / cycle.",
    ))


# ------------------------------------------------------------------------------------------ 07
def _resume_cases(seed: int, device) -> list[Case]:
    rng = np.random.default_rng(seed)
    fixed = [  # (label, prompt_len, mla_reach, checkpoints, mla_block, tail_saved)
        ("the seed's example: history to 3,100, blocks of 1,024", 3300, 3100, [1024, 2048, 3100], 1024,
         False),
        ("the same with the tail saved beside the checkpoint at 3,100", 3300, 3100, [1024, 2048, 3100],
         1024, True),
        ("a checkpoint exactly at the last whole block", 4200, 4100, [2048, 4096], 64, False),
        ("the whole prompt cached, a checkpoint at its end", 5000, 5000, [2048, 4096, 5000], 16, True),
        ("no checkpoint the stored history covers", 900, 700, [768, 896], 64, False),
    ]
    out = [Case(label, {"prompt_len": p, "mla_reach": r, "kda_checkpoints": list(c), "mla_block": b,
                        "tail_saved": t}, EXACT) for label, p, r, c, b, t in fixed]
    for i in range(5):
        block = int(rng.choice([16, 64, 256]))
        prompt = int(rng.integers(500, 20_000))
        reach = int(rng.integers(0, prompt + 1))
        grid = list(range(int(rng.choice([512, 1024, 2048])), prompt + 1, 1024))
        ends = sorted(int(e) for e in rng.integers(1, prompt + 1, size=3))  # earlier turns' ends
        ck = sorted(set(grid + ends))
        out.append(Case(f"random {i + 1}: prompt {prompt}, history {reach}", {
            "prompt_len": prompt, "mla_reach": reach, "kda_checkpoints": ck, "mla_block": block,
            "tail_saved": bool(rng.integers(0, 2))}, EXACT))
    return out


def _resume_reference(case: Case):
    x = case.inputs
    at = resume_point(x["mla_reach"], x["kda_checkpoints"], mla_block=x["mla_block"],
                      tail_saved=x["tail_saved"], limit=x["prompt_len"] - 1)
    return at, x["prompt_len"] - at


def plan_resume_solution(prompt_len, mla_reach, kda_checkpoints, mla_block, tail_saved):
    """The latest checkpoint the stored MLA history covers, and short of the prompt's end (one token
    must run to give logits); 0 when none does. Returns (resume_at, tokens to recompute)."""
    stored = mla_reach if tail_saved else (mla_reach // mla_block) * mla_block
    stored = min(stored, prompt_len - 1)
    at = max([c for c in kda_checkpoints if c <= stored], default=0)
    return at, prompt_len - at


RESUME_STUB = '''\
def plan_resume(prompt_len, mla_reach, kda_checkpoints, mla_block, tail_saved):
    """A returning request of prompt_len tokens. The cache held MLA rows for positions [0, mla_reach),
    kept in whole blocks of mla_block positions unless the last partial block (the tail) was saved
    (tail_saved); KDA state exists only at the positions in kda_checkpoints. Return (resume_at,
    recompute): where the request resumes, and how many prompt tokens must be computed."""
    # TODO: how far the stored MLA history reaches; the latest checkpoint within it
    #       (and at least one prompt token must still run, to give logits); 0 if none.
    raise NotImplementedError("find the resume point")
'''

RESUME = Task(
    name="resume_point", notebook="07_agent_cache", minutes=10,
    statement="""\
**Task: a resume point both caches agree on.** MLA history is stored in whole blocks (unless the tail
was saved with a checkpoint); KDA state exists only at checkpoints. Write `plan_resume(prompt_len,
mla_reach, kda_checkpoints, mla_block, tail_saved)` returning `(resume_at, recompute)`: the latest
checkpoint the stored MLA history covers (at least one prompt token must still run, to produce the
next token's logits; 0 when no checkpoint qualifies) and the number of prompt tokens left to compute.
`check` compares with `k3lab.cache.resume.resume_point` (the seed's 3,072 / 2,048 example is case 1).""",
    signature="plan_resume(prompt_len: int, mla_reach: int, kda_checkpoints: list[int], mla_block: int, "
              "tail_saved: bool) -> (resume_at: int, recompute: int)",
    outputs=("resume_at", "recompute"), cases=_resume_cases, reference=_resume_reference,
    solution=plan_resume_solution, stub=RESUME_STUB,
    forbidden=("k3lab.cache.resume.resume_point", "k3lab.cache.resume.stored_mla_reach"),
    hints=(
        "A request can resume only at a position where both kinds of layer have what they need: MLA rows "
        "for every position before it, and a KDA state saved exactly there.",
        "Without the tail saved only whole blocks were stored, so the MLA history reaches "
        "(mla_reach // mla_block) * mla_block; with it, all of mla_reach. Resume at the latest checkpoint at "
        "or below that reach, but at most prompt_len - 1: one prompt token must run to give the next "
        "token's logits. No checkpoint qualifies: 0.",
        "`stored = mla_reach if tail_saved else mla_reach // mla_block * mla_block`, capped at "
        "`prompt_len - 1`; `at = max([c for c in kda_checkpoints if c <= stored], default=0)`; return "
        "`at` and the tokens still to compute.",
    ))


# ------------------------------------------------------------------------------------------ 08
def _floor_cases(seed: int, device) -> list[Case]:
    rng = np.random.default_rng(seed)
    tp8, tiny = K3Config.tp_slice(8), K3Config.tiny()
    shapes = [("TP8 rank, B = 1, 1K", tp8, 1, 1024), ("TP8 rank, B = 1, 128K", tp8, 1, 131072),
              ("TP8 rank, B = 64, 8K", tp8, 64, 8192), ("tiny preset, B = 3, 40", tiny, 3, 40)]
    shapes.append(("TP8 rank, random", tp8, int(rng.integers(2, 200)), int(rng.integers(100, 200_000))))
    out = []
    for label, cfg, B, ctx in shapes:
        bw = float(rng.choice([4.25, 8.0, 3.2]))
        dense = step_bytes(cfg, B, ctx)["weights_dense"]
        out.append(Case(f"{label}, {bw} TB/s", {"config": cfg, "batch": B, "context_len": ctx,
                                                "dense_weight_bytes": dense, "bandwidth_tbs": bw}, "fp64"))
    return out


def _floor_reference(case: Case) -> float:
    x = case.inputs
    parts = step_bytes(x["config"], x["batch"], x["context_len"])
    total = parts["total"] - parts["weights_dense"] + x["dense_weight_bytes"]
    return total / (x["bandwidth_tbs"] * 1e6)


def step_floor_solution(config, batch, context_len, dense_weight_bytes, bandwidth_tbs):
    """Bytes every step must move once, over the bandwidth, in microseconds (bf16 weights and cache)."""
    c, N = config, batch
    E, k = c.num_experts, c.num_experts_per_token
    chosen = E * (1 - (1 - k / E) ** N)          # distinct experts N tokens choose, uniform routing
    experts = c.num_moe_layers * chosen * 3 * c.moe_intermediate_size * c.routed_expert_hidden_size * 2
    mla = c.num_mla_layers * batch * (context_len + 2) * c.mla_latent_dim * 2
    state = c.num_kda_layers * batch * 2 * c.kda_state_bytes_per_sequence()
    conv = c.num_kda_layers * batch * 2 * c.kda_conv_state_values_per_sequence() * 2
    total = dense_weight_bytes + experts + mla + state + conv
    return total / (bandwidth_tbs * 1e12) * 1e6


FLOOR_STUB = '''\
def step_floor_us(config, batch, context_len, dense_weight_bytes, bandwidth_tbs):
    """The bytes floor of one decode step of one rank (config: a K3Config), in microseconds.
    dense_weight_bytes: every weight but the routed experts, read once (given). bf16: 2 bytes."""
    # TODO: routed experts: num_moe_layers x (distinct experts `batch` tokens choose) x one expert's bytes
    #       MLA history: num_mla_layers x batch x (context_len + 2) x mla_latent_dim x 2
    #       KDA state and conv history: read and written (x 2) per KDA layer and sequence
    #       floor = total bytes / bandwidth
    raise NotImplementedError("count the bytes")
'''

FLOOR = Task(
    name="step_floor", notebook="08_all_together", minutes=15,
    statement="""\
**Task: the bytes floor of a step.** A decode step of one TP8 rank must read every weight it uses once,
the MLA history, and read and write the KDA state. Write `step_floor_us(config, batch, context_len,
dense_weight_bytes, bandwidth_tbs)` in microseconds, with the dense weights given and everything in
bf16 (2 bytes): add the routed experts (`batch` tokens choosing `k` of `E` experts uniformly touch
`E (1 - (1 - k/E)^batch)` distinct experts per MoE layer, each `3 x moe_intermediate_size x
routed_expert_hidden_size` values), the MLA history (`num_mla_layers x batch x (context_len + 2) x
mla_latent_dim`: the history plus the new row written and read), the KDA state
(`kda_state_bytes_per_sequence()`, fp32) and conv history (`kda_conv_state_values_per_sequence()`
values), both read and written per KDA layer. `check` compares with
`k3lab.studies.decode_step.measure.step_bytes`.""",
    signature="step_floor_us(config: K3Config, batch: int, context_len: int, dense_weight_bytes: float, "
              "bandwidth_tbs: float) -> float",
    outputs=("floor_us",), cases=_floor_cases, reference=_floor_reference, solution=step_floor_solution,
    stub=FLOOR_STUB,
    forbidden=("k3lab.studies.decode_step.measure.step_bytes",
               "k3lab.studies.decode_step.measure.part_bytes"),
    hints=(
        "A floor counts the bytes a step cannot avoid moving, once each, and divides by the bandwidth. "
        "List what one decode step must read, and what it must write back.",
        "Besides the dense weights (given): the routed experts the batch touches (tokens share experts: "
        "`batch` tokens choosing k of E uniformly touch E (1 - (1 - k/E)^batch) distinct experts per MoE "
        "layer), the MLA history (context_len + 2 rows per layer and sequence), and the KDA state and conv "
        "history, read and written back (x 2). TB/s is 10^12 bytes per second; answer in microseconds.",
        "`experts = num_moe_layers * chosen * 3 * moe_intermediate_size * routed_expert_hidden_size * 2`; "
        "`mla = num_mla_layers * batch * (context_len + 2) * mla_latent_dim * 2`; "
        "`state = num_kda_layers * batch * 2 * config.kda_state_bytes_per_sequence()`; the conv history "
        "likewise from `kda_conv_state_values_per_sequence()` at 2 bytes; "
        "`total / (bandwidth_tbs * 1e12) * 1e6`.",
    ))
