"""gpt-oss's fused MXFP4 experts in a whole model: ``GptOssExperts`` takes the place of transformers'
``GptOssExperts`` (same call: hidden states [T, H], the router's top-k indices and weights [T, k]),
holding the checkpoint's two projections (``fp8ref.checkpoint.gptoss.ExpertsLayer``). The router is
the model's own; only the experts tokens are routed to run.

Modes (``fp8ref.nn.modes``):

- ``producer``: what transformers 5.17 computes after reloading the checkpoint on CPU: the experts
  dequantized to bf16 by its ``Mxfp4Dequantize`` rule (``ExpertsLayer.experts_weight``, bit for bit),
  then transformers' own experts forward (``config._experts_implementation``: eager or grouped_mm) on
  them, run by the model's original ``GptOssExperts`` instance.
- ``original``: the same forward on the original (unquantized) expert tensors.
- ``reference``: per routed expert, ``x @ W + b`` of each projection as the exact sum of exact
  products rounded once to D (``fp8ref.matmul.global_scaled``, the MX reference of a weight-only
  layer); the swiglu between them (gate = even columns, up = odd: ``clamp(gate, max=limit)``,
  ``clamp(up, -limit, limit)``, ``(up + 1) * gate * sigmoid(alpha * gate)``), the routing weight and the
  sum over experts as the model computes them in D (its ``_apply_gate``, ``index_add_``).
"""

from __future__ import annotations

import numpy as np
import torch

from .._arrays import dtype_name, torch_of
from ..checkpoint.gptoss import ExpertsLayer
from ..codec import decode
from ..errors import ModelError
from ..matmul.global_scaled import global_scaled_linear
from .modes import parse_mode

EXPERTS_CLASS = "GptOssExperts"  # transformers' module this one replaces


class GptOssExperts(torch.nn.Module):
    """The experts of one gpt-oss MLP from the checkpoint's MXFP4 projections. ``model_experts``: the
    model's transformers ``GptOssExperts`` (kept unregistered: its swiglu, alpha, limit and experts
    forward are the model's; its parameters are replaced per mode). ``original``: {"gate_up_proj",
    "gate_up_proj_bias", "down_proj", "down_proj_bias"} tensors in the model layout, for ``original``.
    ``calls``: per expert, how many times mode ``reference`` ran it (once per forward it is routed to)."""

    fp8ref_experts = True  # fp8ref.nn.linear.set_mode switches it with the linears

    def __init__(self, model_experts, gate_up, down, *, mode="reference", original: dict | None = None):
        super().__init__()
        object.__setattr__(self, "_model", model_experts)  # not a submodule: no parameters in state_dict
        self.gate_up, self.down = gate_up, down
        self.name = gate_up.name.rpartition(".")[0]
        self.num_experts = gate_up.experts
        self.original = original
        self.calls = np.zeros(self.num_experts, np.int64)
        self._weights: dict[str, dict] = {}
        self.mode = mode

    @property
    def mode(self):
        return self._mode

    @mode.setter
    def mode(self, value) -> None:
        self._mode = self.check_mode(value)

    def check_mode(self, value):
        mode = parse_mode(value)
        if mode.kind == "original" and self.original is None:
            raise ModelError(f"{self.name}: mode 'original' needs the original weights (--original SRC)")
        if mode.kind == "backend" or (mode.kind == "reference" and mode.arg != "exact"):
            raise ModelError(f"{self.name}: gpt-oss MXFP4 experts run in modes original, reference (exact) and "
                             f"producer; got {mode}")
        return mode

    def extra_repr(self) -> str:
        return f"{self.name!r}, experts={self.num_experts}, mode={self._mode}"

    def _tensors(self, kind: str, dtype: torch.dtype) -> dict:
        """The model-layout parameters of ``kind`` (producer: dequantized; original), made once."""
        if kind not in self._weights:
            if kind == "producer":
                t = {}
                for proj, layer in (("gate_up_proj", self.gate_up), ("down_proj", self.down)):
                    t[proj] = torch_of(layer.experts_weight(str(dtype).removeprefix("torch.")))
                    t[f"{proj}_bias"] = torch_of(np.asarray(layer.bias)).to(dtype)
            else:
                t = {k: v.to(dtype) for k, v in self.original.items()}
            self._weights[kind] = t
        return self._weights[kind]

    @torch.no_grad()
    def forward(self, hidden_states, router_indices=None, routing_weights=None):
        mode = self._mode
        if mode.kind in ("producer", "original"):
            model = self._model
            for name, value in self._tensors(mode.kind, hidden_states.dtype).items():
                # the parameters may be on the meta device (build_model makes them there): replaced, not filled
                model._parameters[name] = torch.nn.Parameter(value, requires_grad=False)
            return model.forward(hidden_states, router_indices, routing_weights)
        return self._reference(hidden_states, router_indices, routing_weights)

    def _reference(self, x, router_indices, routing_weights):
        """transformers' eager loop with each projection's exact MX reference in place of ``@ W + b``."""
        out = torch.zeros_like(x)
        mask = torch.nn.functional.one_hot(router_indices, num_classes=self.num_experts).permute(2, 1, 0)
        for e in torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero().flatten().tolist():
            top_k_pos, token_idx = torch.where(mask[e])
            self.calls[e] += 1
            gate_up = _exact_linear(x[token_idx], self.gate_up, e)
            h = _exact_linear(self._model._apply_gate(gate_up), self.down, e)
            out.index_add_(0, token_idx, (h * routing_weights[token_idx, top_k_pos, None]).to(x.dtype))
        return out


def _exact_linear(x: torch.Tensor, layer, expert: int) -> torch.Tensor:
    """x @ W_e^T + b_e for expert ``expert`` of an ExpertsLayer: exact products, summed exactly,
    rounded once to x's dtype (the reference of a weight-only MX layer)."""
    n, k = layer.expert_shape
    rows = slice(expert * n, (expert + 1) * n)
    codes = layer.weight_codes[rows]
    scale = np.repeat(np.asarray(layer.weight_scale, np.float64)[rows], 32, axis=1)
    w = decode(codes, layer.quant.weight_fmt).astype(np.float64) * scale
    b = np.asarray(layer.bias).astype(np.float64).reshape(layer.experts, n)[expert]
    y = global_scaled_linear(x.detach().to(torch.float64).numpy(), w, 1.0, "multiplier", bias=b,
                             out_dtype=dtype_name(x))
    return torch.from_numpy(y).to(x.dtype)


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


def _original(original, parent: str) -> dict:
    out = {}
    for key in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"):
        name = f"{parent}.{key}"
        if hasattr(original, "store"):
            if name not in original.store:
                raise ModelError(f"{original.path}: no tensor {name!r} for the gpt-oss experts {parent!r}")
            out[key] = torch_of(original.tensor(name))
        else:
            if name not in original:
                raise ModelError(f"original: no tensor {name!r} for the gpt-oss experts {parent!r}")
            v = original[name]
            out[key] = v if isinstance(v, torch.Tensor) else torch_of(np.asarray(v))
    return out
