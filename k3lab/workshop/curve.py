"""Notebook 09's task: where the serving curve bends for a workload the page does not show.

The learner gets a workload (requests' input and output tokens, the prefix cache's hit rate) and a step
that costs `fixed + per sequence + per token of history`, the shape of the page's step model, and must
build the curve themselves: each user's rate falls as the batch's sequences, their histories and the
prefills of the requests that replace them stall every step, while tokens/s/GPU rises with the batch
until it does not. The bend is `k3lab.serving.curve.knee`'s: the first concurrency from which the next
one gains less tokens/s/GPU, relatively, than it costs each user.

The rates follow `k3lab.serving.curve.evaluate` at depth 0 (no speculation): a sequence holds on average
its input and half its output; a request's uncached input is prefilled once and the batch waits, so C
sequences of `output` tokens add C x prefill / output to every step; tokens/s/GPU counts input and output
tokens over the node's 8 GPUs. The cases are fresh random workloads (RAG, agent turns, reasoning, chat)
on the page's concurrency grid, ordered so each common mistake first fails on the case named for it
(BEND_MISTAKES, `_core.cases_exposing`).
"""

from __future__ import annotations

import numpy as np

from ._core import EXACT, Case, Task, cases_exposing

GPUS = 8  # a node's GPUs, over which tokens/s/GPU is counted (k3lab.serving.node.TP)
# The mistakes the cases are built to expose, in case order: no prefill stall at all, or one request's
# (not the batch's C); the prefix cache's hits prefilled anyway; a sequence's history without the output
# it grows while decoding.
BEND_MISTAKES = ("no_prefill", "one_prefill", "no_hit", "input_only_history")
_WORKLOADS = {  # mean input and output tokens and the hit rate drawn from these ranges
    "RAG": ((8_000, 40_000), (100, 600), (0.0, 0.2)),
    "agent turns": ((20_000, 80_000), (200, 1_500), (0.85, 0.97)),
    "reasoning": ((300, 3_000), (4_000, 30_000), (0.0, 0.5)),
    "chat": ((500, 4_000), (200, 1_000), (0.3, 0.8)),
}


def _rates(x: dict, mistake: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(tokens/s/user, tokens/s/GPU) at each concurrency of case inputs x, as `mistake` would have them."""
    mean_in, mean_out = float(np.mean(x["input_tokens"])), float(np.mean(x["output_tokens"]))
    history = mean_in if mistake == "input_only_history" else mean_in + mean_out / 2
    hit = 0.0 if mistake == "no_hit" else x["hit_rate"]
    prefill_us = mean_in * (1 - hit) * x["prefill_us_per_token"]  # one request's uncached input
    C = np.asarray(x["concurrency"], dtype=np.float64)
    stall = {"no_prefill": 0.0 * C, "one_prefill": prefill_us / mean_out + 0.0 * C}.get(
        mistake, C * prefill_us / mean_out)
    step = x["fixed_us"] + C * (x["per_sequence_us"] + x["per_history_token_us"] * history) + stall
    per_user = 1e6 / step
    return per_user, C * per_user * (mean_in + mean_out) / mean_out / GPUS


def _answer(x: dict, mistake: str | None = None) -> int | None:
    """The bend `mistake` finds (None: the right one); None when a comparison on the way is a near-tie."""
    u, g = _rates(x, mistake)
    c = x["concurrency"]
    for i in range(len(c) - 1):
        gain, loss = g[i + 1] / g[i] - 1.0, 1.0 - u[i + 1] / u[i]
        if abs(gain - loss) <= 1e-6 * max(abs(gain), abs(loss)):
            return None
        if gain < loss:
            return int(c[i])
    return int(c[-1])


def _draw(kind: str, label):
    """A draw for cases_exposing: a random workload of kind `kind` (20-60 requests, log-normal around
    random means) and random step costs near an H200 TP8 rank's; label(x) names the case."""
    from k3lab.serving.curve import CONCURRENCY

    mean_in, mean_out, hit = _WORKLOADS[kind]

    def draw(rng):
        n = int(rng.integers(20, 60))
        ins = np.maximum(1, np.round(rng.lognormal(np.log(rng.uniform(*mean_in)), 0.5, n))).astype(int)
        outs = np.maximum(1, np.round(rng.lognormal(np.log(rng.uniform(*mean_out)), 0.5, n))).astype(int)
        x = {"concurrency": list(CONCURRENCY), "input_tokens": ins.tolist(), "output_tokens": outs.tolist(),
             "hit_rate": float(np.round(rng.uniform(*hit), 3)), "fixed_us": float(rng.uniform(8_000, 16_000)),
             "per_sequence_us": float(rng.uniform(20, 120)),
             "per_history_token_us": float(rng.uniform(0.003, 0.01)),
             "prefill_us_per_token": float(rng.uniform(3, 15))}
        return label(x), x
    return draw


def _workload(kind: str, x: dict) -> str:
    return (f"{kind}: {np.mean(x['input_tokens']):,.0f}-token inputs, {x['hit_rate']:.0%} cached, "
            f"{np.mean(x['output_tokens']):,.0f}-token answers")


def _fronts(seed: int, device) -> list[Case]:
    rng = np.random.default_rng(seed)
    steps = [
        (("no_prefill", "one_prefill"), _draw("RAG", lambda x: (
            f"{_workload('RAG', x)}: each request's prefill stalls the batch's every sequence"))),
        (("no_hit",), _draw("agent turns", lambda x: (
            f"{_workload('agent turns', x)}: cached input is not prefilled"))),
        (("input_only_history",), _draw("reasoning", lambda x: (
            f"{_workload('reasoning', x)}: a sequence's history grows as it answers"))),
    ]
    out = [Case(label, x, EXACT) for label, x in cases_exposing(rng, steps, _answer)]
    for kind in ("chat", "agent turns", "RAG"):
        draw = _draw(kind, lambda x, kind=kind: _workload(kind, x))
        label, x = next(c for c in iter(lambda: draw(rng), None) if _answer(c[1]) is not None)
        out.append(Case(label, x, EXACT))
    return out


def _reference(case: Case) -> int:
    from k3lab.serving.curve import knee

    u, g = _rates(case.inputs)
    return knee(case.inputs["concurrency"], u.tolist(), g.tolist())


def bend_solution(concurrency, input_tokens, output_tokens, hit_rate, fixed_us, per_sequence_us,
                  per_history_token_us, prefill_us_per_token):
    """Each step: the fixed cost, every sequence's own and its history's (its input and half its output on
    average), and the prefills of the C / output requests that finish and are replaced each step. A user
    gets one token a step; the GPU C of them, counted with their inputs. The bend: the first concurrency
    whose next one gains less per GPU (relative) than it costs per user."""
    mean_in = sum(input_tokens) / len(input_tokens)
    mean_out = sum(output_tokens) / len(output_tokens)
    prefill = mean_in * (1 - hit_rate) * prefill_us_per_token
    user, gpu = [], []
    for c in concurrency:
        step = (fixed_us + c * (per_sequence_us + per_history_token_us * (mean_in + mean_out / 2))
                + c * prefill / mean_out)
        user.append(1e6 / step)
        gpu.append(c * user[-1] * (mean_in + mean_out) / mean_out / GPUS)
    for i in range(len(concurrency) - 1):
        if gpu[i + 1] / gpu[i] - 1 < 1 - user[i + 1] / user[i]:
            return int(concurrency[i])
    return int(concurrency[-1])


STUB = '''\
def bend(concurrency, input_tokens, output_tokens, hit_rate, fixed_us, per_sequence_us,
         per_history_token_us, prefill_us_per_token):
    """A workload (each request's input and output tokens; hit_rate: the share of input the prefix cache
    serves) decoded on one node at each concurrency C of `concurrency` (rising), no speculation. One step
    of C sequences costs fixed_us + per_sequence_us per sequence + per_history_token_us per token of
    history the sequences hold; uncached input is prefilled at prefill_us_per_token while the batch waits.
    Return the concurrency where the curve bends."""
    # TODO: tokens/s/user and tokens/s/GPU at each C, then where the next C stops paying
    raise NotImplementedError("find the bend")
'''

BEND = Task(
    name="curve_bend", notebook="09_serving_curve", minutes=20,
    statement="""\
**Task: where the curve bends for a workload this page does not show.** Write `bend(concurrency,
input_tokens, output_tokens, hit_rate, fixed_us, per_sequence_us, per_history_token_us,
prefill_us_per_token)`: a node decodes the requests at each concurrency `C` of `concurrency`, without
speculation, and you build its curve. One step of `C` sequences costs `fixed_us`, plus `per_sequence_us`
for each sequence, plus `per_history_token_us` for each token of history the sequences hold (on average
a sequence holds its input and half its output; use the workload's mean input and output). A finished
request is replaced at once by a new one, whose input the prefix cache misses (a share `1 - hit_rate`)
is prefilled at `prefill_us_per_token` while the batch waits. Tokens/s/GPU counts input and output tokens
over the node's 8 GPUs. Return the first concurrency from which the next one gains less tokens/s/GPU,
relatively, than it costs each user in tokens/s/user (the last when every step pays). `check` tries six
fresh workloads against the model's rates and `k3lab.serving.curve.knee`.""",
    signature="bend(concurrency: list[int], input_tokens: list[int], output_tokens: list[int], "
              "hit_rate: float, fixed_us: float, per_sequence_us: float, per_history_token_us: float, "
              "prefill_us_per_token: float) -> int",
    outputs=("concurrency",), cases=_fronts, reference=_reference, solution=bend_solution, stub=STUB,
    forbidden=("k3lab.serving.curve.knee", "k3lab.serving.curve.evaluate", "k3lab.serving.curve.front"),
    hints=(
        "Follow one step of a batch of C sequences: what it costs, what it gives each user (one token), and "
        "what it gives the GPU (C tokens, counted with their inputs). Then walk C upwards and compare what "
        "the GPU gains with what each user loses, both as relative changes.",
        "Per step: fixed_us + C x (per_sequence_us + per_history_token_us x history), history = mean input + "
        "half the mean output. Each step finishes C / mean_output requests on average, and each new one's "
        "uncached input (mean input x (1 - hit_rate)) is prefilled while the batch waits: that adds C x "
        "prefill / mean_output per step. Per user 1e6 / step; per GPU C x per user x (in + out) / out / 8.",
        "`prefill = mean_in * (1 - hit_rate) * prefill_us_per_token`; for each c: `step = fixed_us + c * "
        "(per_sequence_us + per_history_token_us * (mean_in + mean_out / 2)) + c * prefill / mean_out`, "
        "`user = 1e6 / step`, `gpu = c * user * (mean_in + mean_out) / mean_out / 8`; return the first "
        "concurrency[i] with `gpu[i+1] / gpu[i] - 1 < 1 - user[i+1] / user[i]`, else the last.",
    ))
