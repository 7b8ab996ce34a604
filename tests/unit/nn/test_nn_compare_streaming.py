"""compare streams: captured activations go to a spill folder and come back one layer at a time, so
its memory is O(one layer), not O(layers) (tracemalloc sees numpy's buffers, which hold the reloaded
activations), and the report is what the in-memory computation gives."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import numpy as np
import torch

import fp8ref
from fp8ref.io.spill import SpillStore
from fp8ref.nn import Fp8RefLinear
from fp8ref.nn.compare import compare
from fp8ref.nn.metrics import layer_metrics

CKPTS = Path(__file__).resolve().parents[2] / "fixtures" / "interop" / "checkpoints"
IDS = torch.randint(0, 128, (8, 64), generator=torch.Generator().manual_seed(4))


class Chain(torch.nn.Module):
    """An embedding and ``blocks`` up/down pairs of the fixture's layers (a deep model in miniature)."""

    def __init__(self, blocks: int):
        super().__init__()
        ckpt = fp8ref.load_checkpoint(CKPTS / "llmc_fp8")
        g = torch.Generator().manual_seed(0)
        self.embed = torch.randn(128, 64, generator=g).to(torch.bfloat16)
        self.blocks = torch.nn.ModuleList()
        for i in range(blocks):
            pair = torch.nn.ModuleList([Fp8RefLinear(ckpt[f"model.layers.{i % 2}.mlp.up_proj"]),
                                        Fp8RefLinear(ckpt[f"model.layers.{i % 2}.mlp.down_proj"])])
            pair[0].name, pair[1].name = f"blocks.{i}.0", f"blocks.{i}.1"
            self.blocks.append(pair)

    def forward(self, ids):
        h = self.embed[ids]
        for up, down in self.blocks:
            h = h + down(torch.nn.functional.silu(up(h)))
        return h


def _peak(model) -> tuple[int, dict]:
    compare(model, IDS, ["reference", "reference:fp32"])  # warm: lazily read weights stay out of the count
    tracemalloc.start()
    try:
        start = tracemalloc.get_traced_memory()[0]
        report = compare(model, IDS, ["reference", "reference:fp32"])
        peak = tracemalloc.get_traced_memory()[1] - start
    finally:
        tracemalloc.stop()
    return peak, report


def test_memory_is_one_layer_not_all_layers(monkeypatch):
    peak2, _ = _peak(Chain(2))
    peak24, report = _peak(Chain(24))
    assert len(report["layers"]) == 48
    held_all = 48 * IDS.numel() * (64 + 128) * 2  # every layer's bf16 input and output, once
    assert peak24 < peak2 + held_all / 8, (peak2, peak24, held_all)
    # the control: the same measurement sees activations a compare would hold (here: every reload kept)
    from fp8ref.nn import compare as engine

    kept, load = [], engine._load
    monkeypatch.setattr(engine, "_load", lambda store, key: kept.append(load(store, key)) or kept[-1])
    leak24, _ = _peak(Chain(24))
    assert leak24 > peak2 + held_all / 2, (peak2, leak24, held_all)


def test_streamed_report_equals_the_in_memory_metrics():
    model = Chain(3)
    report = compare(model, IDS, ["reference", "reference:fp32"])
    with torch.no_grad():  # the in-memory way: run each layer on the baseline's captured input
        ins, outs = {}, {}

        def keep(m, a, o):
            ins[m.name], outs[m.name] = a[0], o

        hooks = [lin.register_forward_hook(keep) for pair in model.blocks for lin in pair]
        model(IDS)
        for h in hooks:
            h.remove()
    for layer in report["layers"]:
        lin = {lin.name: lin for pair in model.blocks for lin in pair}[layer["name"]]
        want = layer_metrics(lin.run(ins[layer["name"]], "reference:fp32").reshape(-1), outs[layer["name"]].reshape(-1))
        assert layer["teacher_forced"]["reference:fp32"] == want


def test_spill_store_round_trips_bytes(tmp_path):
    import ml_dtypes

    with SpillStore(str(tmp_path)) as s:
        a = np.arange(12, dtype=np.uint16).view(ml_dtypes.bfloat16).reshape(3, 4)
        b = np.linspace(-1, 1, 5).astype(np.float32)
        s.append("x", a)
        s.append("x", b)
        got = s.get("x")
        assert got[0].dtype == a.dtype and got[0].tobytes() == a.tobytes() and got[0].shape == (3, 4)
        assert got[1].dtype == np.float32 and np.array_equal(got[1], b)
        s.drop("x")
        assert s.get("x") == [] and list(tmp_path.iterdir()) != []
    assert list(tmp_path.iterdir()) == []
