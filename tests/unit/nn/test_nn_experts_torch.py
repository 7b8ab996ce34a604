"""fp8ref.nn.experts in the default suite (torch, no transformers): the committed llm-compressor
Qwen3-MoE and DeepSeek-V3 experts placed into a hand-written fused experts module shaped like
transformers 5.x's, run routed-only, their producer weights against torch's own float8 cast, the
hf-fp8 80-row-block rule against a row-by-row oracle, and the Mixtral name warning."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import fp8ref
from fp8ref.errors import Fp8RefError
from fp8ref.nn import set_mode, swap_linears
from fp8ref.nn.experts import Fp8ExpertLinear, Fp8RefExperts
from tests.support.moe_checkpoints import CKPTS

QWEN = CKPTS / "llmc_qwen3_moe_fp8_dynamic"
E, HIDDEN, INTER = 4, 128, 64


class HandExperts(torch.nn.Module):
    """transformers 5.x's fused experts layout and eager forward, written out."""

    def __init__(self):
        super().__init__()
        self.num_experts = E
        self.gate_up_proj = torch.nn.Parameter(torch.zeros(E, 2 * INTER, HIDDEN, dtype=torch.bfloat16))
        self.down_proj = torch.nn.Parameter(torch.zeros(E, HIDDEN, INTER, dtype=torch.bfloat16))
        self.act_fn = torch.nn.SiLU()

    def forward(self, x, top_k_index, top_k_weights):
        out = torch.zeros_like(x)
        for t in range(x.shape[0]):
            for k in range(top_k_index.shape[1]):
                e = int(top_k_index[t, k])
                gate, up = torch.nn.functional.linear(x[t:t + 1], self.gate_up_proj[e]).chunk(2, dim=-1)
                y = torch.nn.functional.linear(self.act_fn(gate) * up, self.down_proj[e])
                out[t:t + 1] += y * top_k_weights[t, k]
        return out


def _model():
    m = torch.nn.Module()
    m.model = torch.nn.Module()
    m.model.layers = torch.nn.ModuleList()
    for _ in range(2):
        layer = torch.nn.Module()
        layer.self_attn = torch.nn.Module()
        for n, (o, i) in {"q_proj": (128, 128), "k_proj": (64, 128), "v_proj": (64, 128), "o_proj": (128, 128)}.items():
            setattr(layer.self_attn, n, torch.nn.Linear(i, o, bias=False))
        layer.mlp = torch.nn.Module()
        layer.mlp.experts = HandExperts()
        m.model.layers.append(layer)
    return m


def _inputs(tokens=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=g).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(tokens)])
    return x, idx, torch.rand(tokens, 2, generator=g).to(torch.bfloat16)


def _torch_dequant(layer) -> torch.Tensor:
    """bfloat16(fp32(q) * fp32(s)) with torch's own float8 cast (the peer, as transformers computes it)."""
    q = torch.from_numpy(np.ascontiguousarray(layer.weight_codes)).view(torch.float8_e4m3fn).float()
    s = torch.from_numpy(np.asarray(layer.weight_scale).astype(np.float32))
    return (q * s).to(torch.bfloat16)


def test_swap_places_one_experts_module_per_block():
    m = _model()
    report = swap_linears(m, fp8ref.load_checkpoint(QWEN))
    assert report.unplaced == [] and len(report.swapped) == 32
    experts = m.model.layers[1].mlp.experts
    assert isinstance(experts, Fp8RefExperts) and experts.name == "model.layers.1.mlp.experts"
    assert [lin.name for lin in experts.projections[2].values()] == [
        f"model.layers.1.mlp.experts.2.{p}" for p in ("gate_proj", "up_proj", "down_proj")]
    assert "gate_up_proj" not in dict(m.named_parameters(prefix="")) and not list(experts.parameters())


def test_reference_runs_each_routed_expert_once_on_its_tokens():
    m = _model()
    swap_linears(m, fp8ref.load_checkpoint(QWEN))
    experts = m.model.layers[0].mlp.experts
    seen = {}
    for lin in experts.modules():
        if isinstance(lin, Fp8ExpertLinear):
            lin.register_forward_hook(lambda mod, a, y: seen.setdefault(mod.name, []).append(a[0].shape[0]))
    x, idx, w = _inputs()
    idx[:, :] = torch.tensor([0, 2])  # experts 1 and 3: no token
    y = experts(x, idx, w)
    assert sorted(seen) == sorted(f"model.layers.0.mlp.experts.{e}.{p}" for e in (0, 2)
                                  for p in ("gate_proj", "up_proj", "down_proj"))
    assert all(v == [7] for v in seen.values())
    # the routed sum: each expert's reference projections, weighted, added in bf16
    layer = {n: lin for n, lin in ((lin.name, lin) for lin in experts.modules() if isinstance(lin, Fp8ExpertLinear))}
    want = torch.zeros_like(x)
    for k, e in enumerate((0, 2)):
        p = f"model.layers.0.mlp.experts.{e}."
        h = torch.nn.functional.silu(layer[p + "gate_proj"].run(x)) * layer[p + "up_proj"].run(x)
        want.index_add_(0, torch.arange(7), (layer[p + "down_proj"].run(h) * w[:, k, None]).to(x.dtype))
    assert torch.equal(y.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("fixture", ["llmc_qwen3_moe_fp8_dynamic", "llmc_qwen3_moe_fp8_block"])
def test_producer_is_the_native_forward_on_bf16_dequantized_experts(fixture):
    """compressed-tensors' experts reload: bfloat16(fp32(q) * fp32(s)) (torch's float8 cast here),
    stacked gate;up, then the model's own experts forward with unquantized inputs."""
    ckpt = fp8ref.load_checkpoint(CKPTS / fixture)
    m = _model()
    swap_linears(m, ckpt, mode="producer")
    native = HandExperts()
    with torch.no_grad():
        for e in range(E):
            p = f"model.layers.0.mlp.experts.{e}."
            native.gate_up_proj[e] = torch.cat([_torch_dequant(ckpt[p + "gate_proj"]),
                                                _torch_dequant(ckpt[p + "up_proj"])])
            native.down_proj[e] = _torch_dequant(ckpt[p + "down_proj"])
        x, idx, w = _inputs(seed=1)
        assert torch.equal(m.model.layers[0].mlp.experts(x, idx, w).view(torch.int16),
                           native(x, idx, w).view(torch.int16))
        set_mode(m, "reference")
        assert not torch.equal(m.model.layers[0].mlp.experts(x, idx, w), native(x, idx, w))


def test_producer_refuses_block_scales_that_do_not_broadcast(tmp_path):
    """transformers' DecompressExperts multiplies weight by scale by broadcasting: a [64, 256] expert
    with [1, 2] block scales fails to load there, and producer mode says so."""
    rng = np.random.default_rng(0)
    src = tmp_path / "src"
    src.mkdir()
    from fp8ref.io.safetensors import write_safetensors

    w = {f"model.layers.0.mlp.experts.0.{p}.weight": ("F32", rng.standard_normal(s).astype(np.float32))
         for p, s in (("gate_proj", (64, 256)), ("up_proj", (64, 256)), ("down_proj", (256, 64)))}
    write_safetensors(src / "model.safetensors", w)
    fp8ref.export_checkpoint(src, tmp_path / "q", {"scheme": "FP8_BLOCK"})
    layer = fp8ref.load_checkpoint(tmp_path / "q")["model.layers.0.mlp.experts.0.gate_proj"]
    lin = Fp8ExpertLinear(layer, "producer")
    with pytest.raises(Fp8RefError, match=r"experts\.0\.gate_proj: transformers' DecompressExperts multiplies the "
                                         r"expert's weight \[64, 256\] by its weight_scale \[1, 2\]"):
        lin(torch.zeros(1, 256, dtype=torch.bfloat16))


def test_hf_fp8_producer_dequantizes_in_transformers_blocks(tmp_path):
    """A [160, 128] kv_a_proj_with_mqa with 128x128 blocks has 2 scale rows: transformers' reload
    puts rows 0-79 under the first and 80-159 under the second (checked row by row here and logit
    by logit against transformers in tests/interop); the declared blocks put 128 rows under the
    first. Loading warns for exactly those layers."""
    from fp8ref.checkpoint.hf_fp8 import transformers_weight
    from fp8ref.codec import decode
    from fp8ref.rounding import round_to

    fp8ref.export_checkpoint(CKPTS / "moe_deepseek_v3_bf16", tmp_path / "hf",
                             {"scheme": {"scheme": "FP8_BLOCK"}, "ignore": ["lm_head", "re:.*mlp\\.gate$"]},
                             format="hf-fp8")
    ckpt = fp8ref.load_checkpoint(tmp_path / "hf")
    quirks = [w for w in ckpt.warnings if "80x128 blocks" in w]
    assert len(quirks) == 2 and all("kv_a_proj_with_mqa" in w for w in quirks)
    layer = ckpt["model.layers.1.self_attn.kv_a_proj_with_mqa"]
    s = np.asarray(layer.weight_scale, np.float32)
    assert s.shape == (2, 1)
    q = decode(layer.weight_codes, "float8_e4m3fn").astype(np.float32)
    rows = [round_to(q[r] * s[r // 80, 0], "bfloat16") for r in range(160)]
    assert np.array_equal(transformers_weight(layer, "bfloat16").view(np.uint32), np.stack(rows).view(np.uint32))
    declared = layer.dequantize("float64")
    assert not np.array_equal(transformers_weight(layer, "float32")[80:128], declared[80:128].astype(np.float32))


def test_mixtral_names_warn_on_load():
    ckpt = fp8ref.load_checkpoint(CKPTS / "llmc_mixtral_fp8_dynamic")
    (w,) = [w for w in ckpt.warnings if "transformers reads" in w]
    assert "24 expert weights named down_proj/gate_proj/up_proj" in w and "would not load these tensors" in w
    assert not [w for w in fp8ref.load_checkpoint(QWEN).warnings if "transformers reads" in w]
    assert not [w for w in fp8ref.load_checkpoint(CKPTS / "moe_mixtral_bf16").warnings if "transformers reads" in w]


def test_free_running_rows_are_aligned_by_token():
    """An expert's free-running rows: the tokens routed to it in both runs, matched by token; the
    share routed to it in one run only is routed_differ."""
    from fp8ref.io.spill import SpillStore
    from fp8ref.nn.compare import _routed_rows, _rows, _spiller

    with SpillStore() as store:
        base, mode = _spiller(store, "base"), _spiller(store, "m")
        x = torch.arange(6, dtype=torch.float32).reshape(3, 2)
        base("e", x, x * 10, torch.tensor([0, 2, 5]))
        mode("e", x + 100, x * 20, torch.tensor([2, 3, 5]))
        ia, ib, differ = _routed_rows(store, "m", "e")
        assert differ == 0.5  # tokens 0 and 3 of {0, 2, 3, 5}
        ys = _rows([torch.from_numpy(a) for a in store.get("m/out/e")], ia)[0]
        ys0 = _rows([torch.from_numpy(a) for a in store.get("base/out/e")], ib)[0]
        assert ys.tolist() == [[0.0, 20.0], [80.0, 100.0]]  # the mode's rows of tokens 2 and 5
        assert ys0.tolist() == [[20.0, 30.0], [40.0, 50.0]]  # the baseline's rows of tokens 2 and 5
        assert _routed_rows(store, "m", "not-an-expert") is None


@pytest.mark.parametrize("fixture, original", [("llmc_qwen3_moe_fp8_dynamic", "moe_qwen3_moe_bf16"),
                                               ("llmc_qwen3_moe_fp8_block", "moe_qwen3_moe_bf16"),
                                               ("llmc_deepseek_v3_fp8_block", "moe_deepseek_v3_bf16"),
                                               ("llmc_mixtral_fp8_dynamic", "moe_mixtral_bf16"),
                                               ("llmc_mixtral_fp8_block", "moe_mixtral_bf16")])
def test_verify_original_on_the_tool_made_moe_checkpoints(fixture, original, capsys):
    """Every expert's codes and scales re-derived from its original weight, byte for byte (Mixtral's
    originals are w1/w3/w2, renamed gate/up/down_proj by llm-compressor: verify's name mapping)."""
    from tests.support.cli import run_cli

    assert run_cli("verify", CKPTS / fixture, "--original", CKPTS / original) == 0
    assert capsys.readouterr().out.rstrip().endswith(": OK")


def test_verify_original_names_the_expert_whose_code_differs(tmp_path, capsys):
    """One FP8 code of one Mixtral expert flipped: verify (originals under w1/w3/w2) exits 1, names that
    expert with the one code and where it is, and the closest recipe with its mismatch count."""
    from fp8ref.io.safetensors import SafetensorsFile, write_safetensors
    from tests.support.cli import run_cli

    src = CKPTS / "llmc_mixtral_fp8_dynamic"
    f = SafetensorsFile(src / "model.safetensors")
    tensors = {n: (f.info(n).dtype, np.array(f.get(n))) for n in f.tensors}
    name = "model.layers.1.block_sparse_moe.experts.2.up_proj"
    tensors[f"{name}.weight"][1].view(np.uint8)[0, 5] ^= 1
    bad = tmp_path / "bad"
    bad.mkdir()
    write_safetensors(bad / "model.safetensors", tensors)
    (bad / "config.json").write_bytes((src / "config.json").read_bytes())
    assert run_cli("verify", bad, "--original", CKPTS / "moe_mixtral_bf16") == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"{name}: recipe 'compressed-tensors': 1 code of 8192 differs (first at [0, 5]), 0 scales differ"
    assert "no known recipe reproduces the bytes, 'compressed-tensors' comes closest (1 mismatch)" in lines[-1]
    assert lines[-1].endswith("MISMATCH in 1 layer")


def test_original_experts_are_read_per_block_not_held():
    """compare --original's MoE experts as dense layers: building reads no original expert tensor (the
    headers are checked), a forward in mode original reads each expert of the block it runs, and
    nothing of them is held after the block (so a model's originals are never all in memory)."""
    original = fp8ref.load_checkpoint(CKPTS / "moe_qwen3_moe_bf16")
    reads: list[str] = []
    tensor = original.tensor
    original.tensor = lambda name: reads.append(name) or tensor(name)
    m = _model()
    swap_linears(m, fp8ref.load_checkpoint(QWEN), original=original)
    assert [n for n in reads if ".experts." in n] == []
    experts = [m.model.layers[i].mlp.experts for i in range(2)]
    lin = experts[0].projections[1]["up"]
    assert lin.original_weight is None and lin.original_source is not None
    set_mode(m, "original")
    x, idx, w = _inputs()
    with torch.no_grad():
        y = experts[0](x, idx, w)
    expert_reads = [n for n in reads if ".experts." in n]
    assert sorted(expert_reads) == sorted(f"model.layers.0.mlp.experts.{e}.{p}_proj.weight"
                                          for e in range(E) for p in ("gate", "up", "down"))
    assert experts[0]._fused == {} and experts[1]._fused == {}  # nothing kept past the forward
    # the same forward as on the original weights fused by hand
    ref = HandExperts()
    with torch.no_grad():
        for e in range(E):
            g, u, d = (tensor(f"model.layers.0.mlp.experts.{e}.{p}_proj.weight") for p in ("gate", "up", "down"))
            ref.gate_up_proj[e] = torch.cat([torch.from_numpy(np.asarray(g, np.float32)),
                                             torch.from_numpy(np.asarray(u, np.float32))]).to(torch.bfloat16)
            ref.down_proj[e] = torch.from_numpy(np.asarray(d, np.float32)).to(torch.bfloat16)
        assert torch.equal(y, ref(x, idx, w))
