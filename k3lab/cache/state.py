"""One request's serving state, moved to host memory and back.

A K3 request carries two kinds of state (docs/k3.md, "State sizes"):
- MLA: one 576-wide latent row per position per MLA layer. Rows are never rewritten, so the history up
  to any position p is simply its first p rows.
- KDA: per layer the conv histories (the last 3 projected inputs) and the fp32 recurrent state. They
  describe the sequence at one position only; a server that wants to resume at position p must have
  saved them at p (a checkpoint).
The AttnRes blocks and partial sum of the last position are saved too (the next step does not read
them; keeping them makes a restored cache equal, entry for entry, to the one that was saved).

`save(cache, request)` copies request `request` of a `K3Cache` to host memory (pinned when a GPU is
present, so that the copy back can be asynchronous); `restore(states, device)` rebuilds a `K3Cache`
of those requests. Restore + continue equals uninterrupted decoding bit for bit: the values are
copied, never converted.

`SequenceCheckpoints` keeps, for one sequence, the MLA history once and KDA checkpoints at chosen
positions, and rebuilds the cache at any checkpoint: the mechanism behind resume points
(k3lab.cache.resume).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..model import K3Cache
from ..nn.kda import KDACache
from ..nn.mla import MLACache
from ..ops import int_arg

_KDA_FIELDS = ("conv_q", "conv_k", "conv_v", "state")


def _host_copy(t: torch.Tensor, pin: bool) -> torch.Tensor:
    """A host copy of `t` that owns its memory (pinned if asked), values unchanged."""
    out = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
    out.copy_(t, non_blocking=False)
    return out


def _want_pin(pin: bool | None) -> bool:
    if pin is None:
        return torch.cuda.is_available()
    if pin and not torch.cuda.is_available():
        raise ValueError("pin=True needs a GPU (pinned host memory is page-locked for DMA); got no GPU")
    return bool(pin)


@dataclass
class RequestState:
    """One request's state at `position` (positions processed), on the host.

    layers[i]: {'latent': [L, 576]} for an MLA layer, {'conv_q','conv_k','conv_v': [C, W-1],
    'state': [H, K, V]} for a KDA layer; attn_res_blocks [S, hidden], attn_res_partial [hidden]."""

    position: int
    kinds: list[str]
    layers: list[dict[str, torch.Tensor]]
    attn_res_blocks: torch.Tensor
    attn_res_partial: torch.Tensor

    def nbytes(self) -> dict[str, int]:
        """Bytes by kind: 'mla_latent', 'kda_state', 'kda_conv', 'attn_res'."""
        out = {"mla_latent": 0, "kda_state": 0, "kda_conv": 0, "attn_res": 0}
        for kind, entries in zip(self.kinds, self.layers):
            for name, t in entries.items():
                key = "mla_latent" if kind == "mla" else ("kda_state" if name == "state" else "kda_conv")
                out[key] += t.numel() * t.element_size()
        out["attn_res"] = sum(t.numel() * t.element_size() for t
                              in (self.attn_res_blocks, self.attn_res_partial))
        return out

    def tensors(self) -> list[torch.Tensor]:
        return [t for entries in self.layers for t in entries.values()] + [self.attn_res_blocks,
                                                                           self.attn_res_partial]


def save(cache: K3Cache, request: int = 0, *, pin: bool | None = None) -> RequestState:
    """Copy request `request` of `cache` to host memory. pin: page-locked host memory (default: when a
    GPU is present). The cache is not modified."""
    if not isinstance(cache, K3Cache):
        raise ValueError(f"cache must be a K3Cache (from K3Model.prefill/decode), got {type(cache).__name__}")
    batch = cache.attn_res_partial.shape[0]
    request = int_arg("request", request, high=batch - 1, what="an index into the cache's batch: an int")
    pin = _want_pin(pin)
    kinds, layers = [], []
    for i, layer in enumerate(cache.layers):
        if isinstance(layer, MLACache):
            kinds.append("mla")
            layers.append({"latent": _host_copy(layer.latent[request], pin)})
        elif isinstance(layer, KDACache):
            kinds.append("kda")
            layers.append({name: _host_copy(getattr(layer, name)[request], pin) for name in _KDA_FIELDS})
        else:
            raise ValueError(f"cache.layers[{i}] must be an MLACache or KDACache, got {type(layer).__name__}")
    return RequestState(cache.length, kinds, layers, _host_copy(cache.attn_res_blocks[:, request], pin),
                        _host_copy(cache.attn_res_partial[request], pin))


def restore(states, device=None) -> K3Cache:
    """A K3Cache on `device` (default: the CPU) holding `states` (one RequestState or a list of them, all
    at the same position and of the same model) as its batch, in that order."""
    if isinstance(states, RequestState):
        states = [states]
    states = list(states)
    if not states or not all(isinstance(s, RequestState) for s in states):
        raise ValueError("states must be a RequestState or a non-empty list of them")
    first = states[0]
    for j, s in enumerate(states[1:], 1):
        if s.position != first.position:
            raise ValueError(f"states must share one position to form a batch: states[0] is at "
                             f"{first.position}, states[{j}] at {s.position}")
        if s.kinds != first.kinds:
            raise ValueError(f"states[{j}] comes from a model with another layer map than states[0]")
    for j, s in enumerate(states):
        int_arg(f"states[{j}].position", s.position)
        for i, (kind, entries) in enumerate(zip(s.kinds, s.layers)):
            if kind != "mla":
                continue
            rows = entries["latent"].shape[0] if isinstance(entries.get("latent"), torch.Tensor) else None
            if rows != s.position:
                raise ValueError(f"states[{j}].position is {s.position}, but MLA layer {i} holds {rows} rows "
                                 "(one per position)")
    device = torch.device("cpu") if device is None else torch.device(device)
    nb = device.type != "cpu"

    def stack(ts):
        return torch.stack([t.to(device, non_blocking=nb) for t in ts])

    layers = []
    for i, kind in enumerate(first.kinds):
        if kind == "mla":
            layers.append(MLACache(stack([s.layers[i]["latent"] for s in states])))
        else:
            layers.append(KDACache(*(stack([s.layers[i][n] for s in states]) for n in _KDA_FIELDS)))
    blocks = stack([s.attn_res_blocks for s in states]).transpose(0, 1).contiguous()
    partial = stack([s.attn_res_partial for s in states])
    return K3Cache(layers, blocks, partial, first.position)


@dataclass
class SequenceCheckpoints:
    """One sequence's reusable state: the MLA history (the longest one saved) and KDA checkpoints.

    add(cache) records the cache's current position as a checkpoint (KDA conv + recurrent state, and
    the MLA rows up to there, kept once: later, longer histories replace shorter ones since rows are
    never rewritten). at(position) rebuilds the K3Cache of that checkpoint."""

    request: int = 0
    pin: bool | None = None
    _mla: RequestState | None = None
    _kda: dict[int, RequestState] = field(default_factory=dict)

    def add(self, cache: K3Cache) -> int:
        state = save(cache, self.request, pin=self.pin)
        kda_only = [{} if k == "mla" else e for k, e in zip(state.kinds, state.layers)]
        self._kda[state.position] = RequestState(state.position, state.kinds, kda_only,
                                                 state.attn_res_blocks, state.attn_res_partial)
        if self._mla is None or state.position >= self._mla.position:
            self._mla = state
        return state.position

    @property
    def positions(self) -> list[int]:
        """Checkpoint positions, ascending."""
        return sorted(self._kda)

    @property
    def mla_reach(self) -> int:
        """How many positions of MLA history are held."""
        return 0 if self._mla is None else self._mla.position

    def nbytes(self) -> dict[str, int]:
        """Host bytes held: the MLA history once, each checkpoint's KDA state and conv."""
        out = {"mla_latent": 0 if self._mla is None else self._mla.nbytes()["mla_latent"],
               "kda_state": 0, "kda_conv": 0}
        for s in self._kda.values():
            n = s.nbytes()
            out["kda_state"] += n["kda_state"]
            out["kda_conv"] += n["kda_conv"]
        return out

    def at(self, position: int, device=None) -> K3Cache:
        """The cache at checkpoint `position` (one of `positions`), on `device`."""
        if isinstance(position, bool) or not isinstance(position, int) or position not in self._kda:
            raise ValueError(f"position must be a checkpoint ({self.positions}), got {position!r}: KDA state "
                             "exists only where it was saved")
        kda = self._kda[position]
        layers = []
        for i, kind in enumerate(kda.kinds):
            layers.append({"latent": self._mla.layers[i]["latent"][:position]} if kind == "mla"
                          else kda.layers[i])
        return restore(RequestState(position, kda.kinds, layers, kda.attn_res_blocks, kda.attn_res_partial),
                       device)
