"""gpt-oss's fused MXFP4 experts in a whole model: ``GptOssExperts`` takes the place of transformers'
``GptOssExperts`` (same call: hidden states [T, H], the router's top-k indices and weights [T, k]),
holding the checkpoint's two projections (``fp8ref.checkpoint.gptoss.ExpertsLayer``). The router is
the model's own; only the experts tokens are routed to run.

Modes (``fp8ref.nn.modes``):

- ``producer``: what transformers 5.17 computes after reloading the checkpoint on CPU: the experts
  dequantized to bf16 by its ``Mxfp4Dequantize`` rule (``ExpertsLayer.experts_weight``, bit for bit),
  then transformers' own experts forward (``config._experts_implementation``: eager or grouped_mm) on
  them, run by the model's original ``GptOssExperts`` instance.
- ``original``: the same forward on the original (unquantized) expert tensors, read from the
  original checkpoint when the mode runs (one experts module's held at a time).
- ``reference[:ACC]``: per routed expert, ``x @ W + b`` of each projection by its
  ``GptOssExpertLinear`` (an ``Fp8RefLinear`` of the expert's rows: the weight-only MX layer; exact:
  the exact sum of exact products rounded once to D, ``fp8ref.matmul.global_scaled``; ``fp32``:
  ``fp8ref.matmul.block_scaled``); the swiglu between them (gate = even columns, up = odd: ``clamp(gate, max=limit)``,
  ``clamp(up, -limit, limit)``, ``(up + 1) * gate * sigmoid(alpha * gate)``), the routing weight and the
  sum over experts as the model computes them in D (its ``_apply_gate``, ``index_add_``).

Each expert projection is a ``GptOssExpertLinear`` named ``M.E.gate_up_proj`` / ``M.E.down_proj``, so
``compare`` reports per-expert rows (in ``producer`` / ``original`` too: the routed projections also
run when compare hooks them; the model's output stays transformers' forward).
"""

from __future__ import annotations

import numpy as np
import torch

from .._arrays import torch_of
from ..checkpoint.gptoss import ExpertsLayer
from ..checkpoint.loader import QuantizedLayer
from ..errors import ModelError
from .linear import Fp8RefLinear
from .modes import parse_mode

EXPERTS_CLASS = "GptOssExperts"  # transformers' module this one replaces


class ExpertSlice(QuantizedLayer):
    """Expert ``expert`` of a fused ``ExpertsLayer`` as a layer of its own ([out, in], its bias row):
    what ``GptOssExpertLinear`` runs, so each expert projection is a row of ``compare``. Reads the
    expert's packed rows and scales from the checkpoint on each use (nothing held)."""

    def __init__(self, fused, expert: int, name: str):  # a view: the fused layer reads the tensors
        self._fused, self.expert = fused, expert
        self._ckpt, self.entry, self.name = fused._ckpt, fused.entry, name
        self.quant, self.producer, self.scheme, self.tensors = fused.quant, fused.producer, fused.scheme, fused.tensors
        self.shape = tuple(int(n) for n in fused.expert_shape)

    def __repr__(self) -> str:
        return f"ExpertSlice({self.name!r}, [out, in] {list(self.shape)})"

    def _rows(self) -> slice:
        n = self.shape[0]
        return slice(self.expert * n, (self.expert + 1) * n)

    @property
    def weight_codes(self) -> np.ndarray:
        from ..io.safetensors import unpack_nibbles

        n, k = self.shape
        packed = self._ckpt.store.get(self.tensors["weight"])  # [E, out, in/32, 16]
        return unpack_nibbles(np.ascontiguousarray(packed[self.expert]).reshape(n, k // 2))

    def _tensor(self, role: str, *, bf16_bits: bool = False):
        v = self._fused._tensor(role, bf16_bits=bf16_bits)
        if v is None:
            return None
        if role == "bias":
            return np.asarray(v).reshape(self._fused.experts, self.shape[0])[self.expert]
        return v[self._rows()] if role == "weight_scale" else v


class GptOssExpertLinear(Fp8RefLinear):
    """One projection of one gpt-oss expert. ``reference[:ACC]``: the weight-only MX layer
    (``Fp8RefLinear``); ``producer`` / ``original``: ``x @ W + b`` in the model dtype with W the
    model-layout [in, out] weight (transformers' reload / the original), as transformers' eager
    experts forward computes it (a matmul, then the bias added)."""

    def __init__(self, layer: ExpertSlice, experts: GptOssExperts, proj: str):
        object.__setattr__(self, "_experts", experts)  # not a submodule (set first: check_mode may read it)
        super().__init__(layer, "reference", original_source=None if experts.original is None else self._original)
        self.proj = proj

    def check_mode(self, value):
        mode = parse_mode(value, accumulate=self.accumulate)
        if mode.kind == "producer":  # transformers' reload of the experts (GptOssExperts), not a linear's
            return mode
        return super().check_mode(mode)

    def _model_weights(self, kind: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        t = self._experts._tensors(kind, dtype)
        e = self.layer.expert
        return t[self.proj][e], t[f"{self.proj}_bias"][e]

    def _original(self):
        w, b = self._model_weights("original", torch.float32)
        return w.T, b

    @torch.no_grad()
    def run(self, x: torch.Tensor, mode=None) -> torch.Tensor:
        mode = self._mode if mode is None else self.check_mode(mode)
        if mode.kind in ("producer", "original"):
            if x.shape[-1] != self.in_features:
                raise ModelError(f"{self.name}: input of shape {list(x.shape)}, expected (..., {self.in_features})")
            w, b = self._model_weights(mode.kind, x.dtype)
            return x.detach() @ w + b
        return super().run(x, mode)


class GptOssExperts(torch.nn.Module):
    """The experts of one gpt-oss MLP from the checkpoint's MXFP4 projections. ``model_experts``: the
    model's transformers ``GptOssExperts`` (kept unregistered: its swiglu, alpha, limit and experts
    forward are the model's; its parameters are replaced per mode). ``original``: a function returning
    {"gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"} in the model layout, read from
    the original checkpoint when mode ``original`` runs (``_original``: one experts module's held at a
    time). ``projections[e]``: expert e's {"gate_up", "down"} ``GptOssExpertLinear``.
    ``calls``: per expert, how many times mode ``reference`` ran it (once per forward it is routed to)."""

    fp8ref_experts = True  # fp8ref.nn.linear.set_mode switches it with the linears

    def __init__(self, model_experts, gate_up, down, *, mode="reference", original=None):
        super().__init__()
        object.__setattr__(self, "_model", model_experts)  # not a submodule: no parameters in state_dict
        self.gate_up, self.down = gate_up, down
        self.name = gate_up.name.rpartition(".")[0]
        self.num_experts = gate_up.experts
        self.original = original
        self.calls = np.zeros(self.num_experts, np.int64)
        self._weights: dict[str, dict] = {}
        self.projections = torch.nn.ModuleList(torch.nn.ModuleDict({
            role: GptOssExpertLinear(ExpertSlice(fused, e, f"{self.name}.{e}.{proj}"), self, proj)
            for role, proj, fused in (("gate_up", "gate_up_proj", gate_up), ("down", "down_proj", down))
        }) for e in range(self.num_experts))
        self.mode = mode

    @property
    def mode(self):
        return self._mode

    @mode.setter
    def mode(self, value) -> None:
        self._mode = self.check_mode(value)
        for p in self.projections:
            for lin in p.values():
                lin._mode = self._mode

    def check_mode(self, value):
        """``value`` parsed, with what it needs; reference[:ACC] and backend as the projections allow
        (a weight-only MX layer: exact and fp32; no backend case takes 16-bit activations)."""
        mode = parse_mode(value)
        if mode.kind == "original" and self.original is None:
            raise ModelError(f"{self.name}: mode 'original' needs the original weights (--original SRC)")
        if mode.kind in ("reference", "backend"):
            self.projections[0]["gate_up"].check_mode(mode)
        return mode

    def extra_repr(self) -> str:
        return f"{self.name!r}, experts={self.num_experts}, mode={self._mode}"

    def _tensors(self, kind: str, dtype: torch.dtype) -> dict:
        """The model-layout parameters of ``kind`` in ``dtype``: producer's dequantized once and kept;
        original's read through ``self.original`` (its one-slot cache), not kept here."""
        if kind == "original":
            return {k: v.to(dtype) for k, v in self.original().items()}
        if kind not in self._weights or self._weights[kind]["gate_up_proj"].dtype != dtype:
            from .._arrays import torch_of

            t = {}
            for proj, layer in (("gate_up_proj", self.gate_up), ("down_proj", self.down)):
                t[proj] = torch_of(layer.experts_weight(str(dtype).removeprefix("torch.")))
                t[f"{proj}_bias"] = torch_of(np.asarray(layer.bias)).to(dtype)
            self._weights[kind] = t
        return self._weights[kind]

    def _hooked(self) -> bool:
        return any(lin._forward_hooks for p in self.projections for lin in p.values())

    @torch.no_grad()
    def forward(self, hidden_states, router_indices=None, routing_weights=None):
        mode = self._mode
        if mode.kind in ("producer", "original"):
            model = self._model
            before = dict(model._parameters)
            for name, value in self._tensors(mode.kind, hidden_states.dtype).items():
                # the parameters may be on the meta device (build_model makes them there): replaced, not filled
                model._parameters[name] = torch.nn.Parameter(value, requires_grad=False)
            try:
                out = model.forward(hidden_states, router_indices, routing_weights)
            finally:
                if mode.kind == "original":  # not held past this forward (the next module's replace them)
                    model._parameters.update(before)
            if self._hooked():  # compare's capture: this mode's per-expert rows too
                self._routed(hidden_states, router_indices, routing_weights, count=False)
            return out
        return self._routed(hidden_states, router_indices, routing_weights)

    def _routed(self, x, router_indices, routing_weights, *, count: bool = True):
        """transformers' eager loop, each projection of each routed expert by its ``GptOssExpertLinear``."""
        out = torch.zeros_like(x)
        mask = torch.nn.functional.one_hot(router_indices, num_classes=self.num_experts).permute(2, 1, 0)
        for e in torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero().flatten().tolist():
            top_k_pos, token_idx = torch.where(mask[e])
            if count:
                self.calls[e] += 1
            p = self.projections[e]
            for lin in p.values():  # which rows of the batch each call saw (compare aligns the runs by them)
                lin.routed_tokens = token_idx
            h = p["down"](self._model._apply_gate(p["gate_up"](x[token_idx])))
            out.index_add_(0, token_idx, (h * routing_weights[token_idx, top_k_pos, None]).to(x.dtype))
        return out


def swap_gptoss_experts(model: torch.nn.Module, checkpoint, report, *, mode="reference", original=None) -> None:
    """Put a ``GptOssExperts`` in place of each transformers ``GptOssExperts`` whose two projections
    the checkpoint holds as gpt-oss MXFP4 experts, moving them from ``report.unplaced`` (where
    ``swap_linears`` left them: not nn.Linear) to ``report.swapped``; a module that is missing, of
    another type, or whose experts count or shapes disagree with the checkpoint stays unplaced with why."""
    unplaced = dict(report.unplaced)
    modules: dict[str, dict] = {}
    for name in unplaced:
        layer = checkpoint[name]
        if isinstance(layer, ExpertsLayer):
            parent, _, proj = name.rpartition(".")
            modules.setdefault(parent, {})[proj] = layer
    for parent, projs in modules.items():
        why = _fit(model, parent, projs)
        if why:
            for name in (f"{parent}.{p}" for p in projs):
                unplaced[name] = why
            continue
        target = model.get_submodule(parent)
        orig = None if original is None else _original(original, parent)
        new = GptOssExperts(target, projs["gate_up_proj"], projs["down_proj"], mode="reference", original=orig)
        new.mode = mode
        owner, _, attr = parent.rpartition(".")
        setattr(model.get_submodule(owner) if owner else model, attr, new)
        for proj in projs:
            unplaced.pop(f"{parent}.{proj}")
            report.swapped.append(f"{parent}.{proj}")
    report.unplaced = list(unplaced.items())


def _fit(model, parent: str, projs: dict) -> str | None:
    """Why the checkpoint's experts at ``parent`` do not fit the model (None: they do)."""
    try:
        target = model.get_submodule(parent)
    except AttributeError:
        return "no module of that name"
    if type(target).__name__ != EXPERTS_CLASS:
        return f"is a {type(target).__name__}, not transformers' {EXPERTS_CLASS}"
    gate_up, down = projs.get("gate_up_proj"), projs.get("down_proj")
    if gate_up is None or down is None:
        return "the checkpoint holds one of gate_up_proj and down_proj only"
    e, h, i = target.num_experts, target.hidden_size, target.intermediate_size
    want = {"gate_up_proj": (2 * i, h), "down_proj": (h, i)}
    for proj, layer in projs.items():
        if layer.experts != e or tuple(layer.expert_shape) != want[proj]:
            return (f"{layer.experts} experts of [out, in] {list(layer.expert_shape)} in the checkpoint, the model's "
                    f"config has {e} of {list(want[proj])}")
    return None


_KEYS = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
_HELD: dict[str, dict] = {}  # the one experts module whose original tensors are held (one slot)


def _original(original, parent: str):
    """A function returning the original tensors of the experts at ``parent`` (checked present now).
    A Checkpoint's are read when called, the last module's kept in a one-slot cache so that its
    per-expert rows read them once: O(one experts module), not O(model)."""

    names = {key: f"{parent}.{key}" for key in _KEYS}
    held = original.store if hasattr(original, "store") else original
    for name in names.values():
        if name not in held:
            raise ModelError(f"{getattr(original, 'path', 'original')}: no tensor {name!r} for the gpt-oss experts "
                             f"{parent!r}")
    if not hasattr(original, "store"):
        given = {k: (v if isinstance(v, torch.Tensor) else torch_of(np.asarray(v)))
                 for k, v in ((k, original[n]) for k, n in names.items())}
        return lambda: given
    slot = f"{original.path}:{parent}"

    def read() -> dict:
        if slot not in _HELD:
            _HELD.clear()
            _HELD[slot] = {k: torch_of(original.tensor(n)) for k, n in names.items()}
        return _HELD[slot]
    return read
