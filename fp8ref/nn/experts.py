"""MoE experts: ``Fp8RefExperts`` runs a model's fused experts module (transformers 5.x's
``gate_up_proj`` [E, 2I, H] / ``down_proj`` [E, H, I] of Qwen3-MoE, Mixtral, DeepSeek-V3, ...) from
the checkpoint's per-expert layers ``BLOCK.experts.N.{gate,up,down}_proj`` (Mixtral's ``w1/w3/w2``).

The router and the gating stay the model's own: the model calls ``experts(hidden, top_k_index,
top_k_weights)`` as before. Each expert projection is an ``Fp8ExpertLinear`` (an ``Fp8RefLinear``),
so ``compare`` reports per-expert rows. Per mode:

- ``reference[:ACC]`` / ``backend:NAME``: only the experts some token is routed to run, each on its
  tokens (activations quantized as the layer declares: its own static input scale, or per token);
  gate and up combined by the model's own activation, the expert outputs weighted and summed in the
  model dtype as transformers' eager experts forward does (``index_add_``).
- ``producer``: what transformers' reload computes: the fused parameters filled with each expert's
  dequantized weight as the producer's loader makes it (``CheckpointFormat.emulate_experts``), then
  the model's own experts forward (whichever ``experts_implementation`` the model was built with),
  with no activation quantization: the reload never wraps the fused experts in a quantized linear.
- ``original``: the same forward on the original weights, read from the original checkpoint on
  each forward of the block (held for that block's forward only, as dense layers' originals are).

Only ``reference``/``backend`` run the projections one by one; in ``producer``/``original`` the
per-expert projections run too (on the tokens routed to them) when something hooks them (``compare``'s
capture), so their rows exist in every mode; the model's output is the fused forward's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import torch

from .._arrays import torch_of
from ..checkpoint import base
from ..errors import ModelError
from .linear import Fp8RefLinear

# BLOCK.experts.N.PROJ: transformers' checkpoint names (Mixtral's w1/w3/w2 are gate/up/down)
EXPERT_NAME = re.compile(r"^(?P<block>.+)\.experts\.(?P<index>\d+)\.(?P<proj>gate_proj|up_proj|down_proj|w1|w3|w2)$")
ROLES = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}
ALIASES = {"gate": ("gate_proj", "w1"), "up": ("up_proj", "w3"), "down": ("down_proj", "w2")}
# module renamings transformers' conversion mapping applies at load (checkpoint -> model)
BLOCK_RENAMES = ((".block_sparse_moe", ".mlp"),)


@dataclass(frozen=True)
class ExpertName:
    block: str  # the MoE block as the checkpoint names it (model.layers.0.block_sparse_moe)
    index: int
    role: str  # gate, up or down


def expert_name(name: str) -> ExpertName | None:
    """The parts of an expert projection's checkpoint name, or None for any other layer."""
    m = EXPERT_NAME.match(name)
    return None if m is None else ExpertName(m["block"], int(m["index"]), ROLES[m["proj"]])


def is_fused_experts(module) -> bool:
    """A transformers fused experts module: 3-D gate_up_proj [E, 2I, H] and down_proj [E, H, I]."""
    gu, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return (isinstance(gu, torch.Tensor) and isinstance(down, torch.Tensor) and gu.ndim == 3 and down.ndim == 3
            and getattr(module, "is_concatenated", True) and not getattr(module, "is_transposed", False)
            and not getattr(module, "has_bias", False))


def find_experts(model, block: str) -> tuple[str, torch.nn.Module] | None:
    """(path, module) of the fused experts of the checkpoint's MoE block ``block`` in ``model``."""
    for path in _block_paths(block):
        try:
            module = model.get_submodule(f"{path}.experts")
        except AttributeError:
            continue
        return f"{path}.experts", module
    return None


def _block_paths(block: str) -> list[str]:
    paths = [block]
    for old, new in BLOCK_RENAMES:
        if old in block:
            paths.append(block.replace(old, new))
    return paths


class Fp8ExpertLinear(Fp8RefLinear):
    """One expert projection. ``producer`` is the producer's reload of an expert (its
    ``emulate_experts`` weight, the input not quantized), not that of a linear layer."""

    _producer = None

    def producer_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The D weight the producer's reload gives this expert (computed once per dtype)."""
        if self._producer is None or self._producer.dtype != dtype:
            emulate = base.get(self.layer.producer).emulate_experts
            if emulate is None:
                raise ModelError(f"{self.name}: no producer emulation of MoE experts for "
                                 f"{self.layer.producer!r} checkpoints; use mode='reference'")
            w = emulate(self.layer, str(dtype).removeprefix("torch."))
            self._producer = torch.from_numpy(np.ascontiguousarray(w, np.float32)).to(dtype)
        return self._producer

    @torch.no_grad()
    def run(self, x: torch.Tensor, mode=None) -> torch.Tensor:
        mode = self._mode if mode is None else self.check_mode(mode)
        if mode.kind == "producer":
            if x.shape[-1] != self.in_features:
                raise ModelError(f"{self.name}: input of shape {list(x.shape)}, expected (..., {self.in_features})")
            return torch.nn.functional.linear(x.detach(), self.producer_weight(x.dtype))
        return super().run(x, mode)


class Fp8RefExperts(torch.nn.Module):
    """The experts of one MoE block, in place of the model's fused experts module ``native``
    (kept, without its two weight parameters, for its own forward, activation and config).
    ``projections[e]``: expert e's gate / up / down ``Fp8ExpertLinear`` by role."""

    def __init__(self, native: torch.nn.Module, projections: list[dict[str, Fp8ExpertLinear]], name: str):
        super().__init__()
        self.name = name
        self.dtype = native.gate_up_proj.dtype
        self.num_experts = len(projections)
        self.projections = torch.nn.ModuleList(torch.nn.ModuleDict(p) for p in projections)
        del native.gate_up_proj, native.down_proj  # the module's weights are ours, set per mode
        self.__dict__["native"] = native  # not a child: no parameters, no state_dict entries
        self._fused: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def extra_repr(self) -> str:
        return f"{self.name!r}, experts={self.num_experts}, native={type(self.native).__name__}"

    @property
    def mode(self):
        return self.projections[0]["down"].mode

    def _fused_weights(self, mode) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [E, 2I, H], down [E, H, I]) in the model dtype for ``producer`` / ``original``."""
        key = str(mode)
        if key in self._fused:
            return self._fused[key]

        def weight(lin):
            if mode.kind == "original":
                return lin.original_tensors()[0].to(self.dtype)
            return lin.producer_weight(self.dtype)

        gate_up = torch.stack([torch.cat([weight(p["gate"]), weight(p["up"])]) for p in self.projections])
        down = torch.stack([weight(p["down"]) for p in self.projections])
        if mode.kind == "original":  # read per forward, as dense layers' originals: never held past this block
            return gate_up, down
        self._fused[key] = (gate_up, down)
        for p in self.projections:  # one copy of the dequantized experts: the fused one
            for lin in p.values():
                lin._producer = None
        return self._fused[key]

    def release_fused(self) -> None:
        """Drop the fused weights kept for producer / original (made again on their next forward)."""
        self._fused.clear()

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        mode = self.mode
        if mode.kind in ("producer", "original"):
            native = self.native
            native.gate_up_proj, native.down_proj = self._fused_weights(mode)
            try:
                out = native.forward(hidden_states, top_k_index, top_k_weights)
            finally:
                del native.gate_up_proj, native.down_proj
            if self._hooked():
                self._routed(hidden_states, top_k_index, top_k_weights)
            return out
        return self._routed(hidden_states, top_k_index, top_k_weights)

    def _hooked(self) -> bool:
        return any(lin._forward_hooks for p in self.projections for lin in p.values())

    @torch.no_grad()
    def _routed(self, hidden_states, top_k_index, top_k_weights) -> torch.Tensor:
        """transformers' eager experts forward, each expert hit by some token through its projections."""
        final = torch.zeros_like(hidden_states)
        mask = torch.nn.functional.one_hot(top_k_index, num_classes=self.num_experts).permute(2, 1, 0)
        for e in torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()[:, 0].tolist():
            pos, token = torch.where(mask[e])
            x = hidden_states[token]
            p = self.projections[e]
            for lin in p.values():  # which rows of the batch each call saw (compare aligns the runs by them)
                lin.routed_tokens = token
            h = self.native.act_fn(p["gate"](x)) * p["up"](x)
            y = p["down"](h) * top_k_weights[token, pos, None]
            final.index_add_(0, token, y.to(final.dtype))
        return final


def place_experts(model, checkpoint, names: list[str], report, make) -> None:
    """Put an ``Fp8RefExperts`` in place of each fused experts module ``names`` (expert projection
    layers of ``checkpoint``) belong to; ``make(layer, name)`` builds one ``Fp8ExpertLinear``.
    What cannot be placed goes to ``report.unplaced``; an expert set that disagrees with the model
    (count, shapes, a projection missing) is an error naming the tensor."""
    blocks: dict[str, dict[tuple[int, str], str]] = {}
    for name in names:
        part = expert_name(name)
        blocks.setdefault(part.block, {})[(part.index, part.role)] = name
    for block, members in blocks.items():
        found = find_experts(model, block)
        if found is None:
            report.unplaced.extend((n, "no module of that name") for n in members.values())
            continue
        path, native = found
        if not is_fused_experts(native):
            report.unplaced.extend((n, f"{path} is a {type(native).__name__}, not fused experts (gate_up_proj "
                                       f"[E, 2I, H], down_proj [E, H, I])") for n in members.values())
            continue
        n_exp, two_i, hidden = native.gate_up_proj.shape
        inter = two_i // 2
        where = getattr(checkpoint, "path", "checkpoint")
        for (e, role), name in sorted(members.items()):
            if e >= n_exp:
                raise ModelError(f"{where}: {name}: expert {e}, but the model's {path} has {n_exp} experts "
                                 f"(config)")
            want = (hidden, inter) if role == "down" else (inter, hidden)
            if tuple(checkpoint[name].shape) != want:
                raise ModelError(f"{where}: {name}: weight {list(checkpoint[name].shape)}, the model's {path} "
                                 f"expects {list(want)} for a {role} projection (config)")
        projections = []
        for e in range(n_exp):
            p = {}
            for role in ("gate", "up", "down"):
                name = members.get((e, role))
                if name is None:
                    raise ModelError(f"{where}: {block}.experts.{e}.{ALIASES[role][0]}: missing; the model's "
                                     f"{path} has {n_exp} experts, each with gate, up and down projections, and "
                                     f"the checkpoint quantizes {len(members)} of their {3 * n_exp} layers")
                p[role] = make(checkpoint[name], name)
            projections.append(p)
        new = Fp8RefExperts(native, projections, path)
        parent, _, attr = path.rpartition(".")
        setattr(model.get_submodule(parent), attr, new)
        report.swapped.extend(members.values())


def original_expert_key(original, name: str) -> str | None:
    """The name ``original`` (a Checkpoint or a mapping) holds expert projection ``name``'s weight
    under, among transformers' names for it (llm-compressor writes Mixtral's w1/w3/w2 as
    gate/up/down_proj), or None."""
    part = expert_name(name)
    if part is None:
        return None
    held = original.store if hasattr(original, "store") else original
    for block in _block_paths(part.block):
        for proj in ALIASES[part.role]:
            key = f"{block}.experts.{part.index}.{proj}.weight"
            if key in held:
                return key
    return None


def original_expert_weight(original, name: str):
    """The original tensor of expert projection ``name`` (``original_expert_key``), read now, or None."""
    key = original_expert_key(original, name)
    if key is None:
        return None
    if hasattr(original, "store"):
        return torch_of(original.tensor(key))
    v = original[key]
    return v if isinstance(v, torch.Tensor) else torch_of(np.asarray(v))


def fuse_unquantized_experts(model, ckpt) -> tuple[dict[str, torch.Tensor], set[str]]:
    """Per-expert unquantized tensors of ``ckpt`` (``BLOCK.experts.N.PROJ.weight``) as the model's
    fused parameters, and tensors of a renamed MoE block (``BLOCK_RENAMES``) under the model's names:
    ({model tensor name: tensor}, the checkpoint names consumed). The model's fused experts left
    without any checkpoint tensor (a router without experts) are an error."""
    groups: dict[str, dict[tuple[int, str], str]] = {}
    for name in ckpt.unquantized:
        if not name.endswith(".weight"):
            continue
        part = expert_name(name[: -len(".weight")])
        if part is not None:
            groups.setdefault(part.block, {})[(part.index, part.role)] = name
    fused, used = {}, set()
    for block, members in groups.items():
        found = find_experts(model, block)
        if found is None or not is_fused_experts(found[1]):
            continue  # reported by load_unquantized as tensors the model has no place for
        path, native = found
        n_exp, two_i, hidden = native.gate_up_proj.shape
        inter = two_i // 2
        parts = {"gate": [], "up": [], "down": []}
        for e in range(n_exp):
            for role, want in (("gate", (inter, hidden)), ("up", (inter, hidden)), ("down", (hidden, inter))):
                name = members.get((e, role))
                if name is None:
                    raise ModelError(f"{ckpt.path}: {block}.experts.{e}.{ALIASES[role][0]}.weight: missing; the "
                                     f"model's {path} has {n_exp} experts (config)")
                t = torch_of(ckpt.tensor(name))
                if tuple(t.shape) != want:
                    raise ModelError(f"{ckpt.store.where(name)}: shape {list(t.shape)}, the model's {path} expects "
                                     f"{list(want)} (config)")
                parts[role].append(t)
        extra = sorted(n for (e, _), n in members.items() if e >= n_exp)
        if extra:
            raise ModelError(f"{ckpt.store.where(extra[0])}: expert beyond the model's {n_exp} experts of {path} "
                             f"(config)")
        fused[f"{path}.gate_up_proj"] = torch.stack([torch.cat([g, u]) for g, u in zip(parts["gate"], parts["up"])])
        fused[f"{path}.down_proj"] = torch.stack(parts["down"])
        used.update(members.values())
    state = model.state_dict()
    for name in ckpt.unquantized:  # the MoE block's other tensors (Mixtral's router) under the model's name
        if name not in state and name not in used:
            renamed = next((n for n in _block_paths(name)[1:] if n in state), None)
            if renamed is not None:
                fused[renamed] = torch_of(ckpt.tensor(name))
                used.add(name)
    for path, module in model.named_modules():
        if is_fused_experts(module) and f"{path}.gate_up_proj" in state and f"{path}.gate_up_proj" not in fused \
                and f"{path}.gate_up_proj" not in ckpt.unquantized:
            router = [n for n in ckpt.unquantized if n.startswith(path.rpartition(".")[0] + ".")]
            raise ModelError(f"{ckpt.path}: {path}: the model has {module.gate_up_proj.shape[0]} experts here and "
                             f"the checkpoint none (no {path}.N.gate_proj/up_proj/down_proj)"
                             + (f"; it holds only {', '.join(sorted(router)[:3])}" if router else ""))
    return fused, used
