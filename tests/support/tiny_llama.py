"""A hand-written Llama in plain torch (no transformers) with the interop fixtures' architecture
(tests/fixtures/interop/checkpoints: hidden 64, 2 layers, 4 heads, 2 KV heads, vocab 128), and a
hand-written W8A8 linear with fp32 accumulation in the order docs/matmul.md declares. The model is
the harness; the linears are what tests compare."""

from __future__ import annotations

import torch

HIDDEN, INTER, LAYERS, HEADS, KV_HEADS, VOCAB, HEAD_DIM = 64, 128, 2, 4, 2, 128, 16
EPS, THETA = 1e-6, 10000.0
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")
SHAPES = {"self_attn.q_proj": (HEADS * HEAD_DIM, HIDDEN), "self_attn.k_proj": (KV_HEADS * HEAD_DIM, HIDDEN),
          "self_attn.v_proj": (KV_HEADS * HEAD_DIM, HIDDEN), "self_attn.o_proj": (HIDDEN, HEADS * HEAD_DIM),
          "mlp.gate_proj": (INTER, HIDDEN), "mlp.up_proj": (INTER, HIDDEN), "mlp.down_proj": (HIDDEN, INTER)}


class RMSNorm(torch.nn.Module):
    def __init__(self, n):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(n))

    def forward(self, x):
        v = x.float()
        v = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + EPS)
        return self.weight * v.to(x.dtype)


def _rope(x, pos):
    inv = 1.0 / (THETA ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM))
    ang = pos[:, None].float() * inv[None, :]
    cos, sin = torch.cat([ang.cos()] * 2, -1).to(x.dtype), torch.cat([ang.sin()] * 2, -1).to(x.dtype)
    x1, x2 = x[..., : HEAD_DIM // 2], x[..., HEAD_DIM // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class Attention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
            out, inp = SHAPES[f"self_attn.{n}"]
            setattr(self, n, torch.nn.Linear(inp, out, bias=False))

    def forward(self, x):
        B, T, _ = x.shape
        pos = torch.arange(T)
        q = self.q_proj(x).view(B, T, HEADS, HEAD_DIM).transpose(1, 2)
        k = self.k_proj(x).view(B, T, KV_HEADS, HEAD_DIM).transpose(1, 2)
        v = self.v_proj(x).view(B, T, KV_HEADS, HEAD_DIM).transpose(1, 2)
        q, k = _rope(q, pos), _rope(k, pos)
        k = k.repeat_interleave(HEADS // KV_HEADS, dim=1)
        v = v.repeat_interleave(HEADS // KV_HEADS, dim=1)
        att = (q @ k.transpose(-1, -2)) / HEAD_DIM ** 0.5
        att = att.masked_fill(torch.triu(torch.ones(T, T, dtype=torch.bool), 1), float("-inf")).softmax(-1)
        return self.o_proj((att @ v).transpose(1, 2).reshape(B, T, HEADS * HEAD_DIM))


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        for n in ("gate_proj", "up_proj", "down_proj"):
            out, inp = SHAPES[f"mlp.{n}"]
            setattr(self, n, torch.nn.Linear(inp, out, bias=False))

    def forward(self, x):
        return self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(HIDDEN), RMSNorm(HIDDEN)
        self.self_attn, self.mlp = Attention(), MLP()

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Inner(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(VOCAB, HIDDEN)
        self.layers = torch.nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = RMSNorm(HIDDEN)


class TinyLlama(torch.nn.Module):
    """Named like transformers' LlamaForCausalLM, so checkpoint tensor names fit; returns logits."""

    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.model = Inner()
        self.lm_head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
        self.to(dtype)

    def forward(self, ids):
        x = self.model.embed_tokens(ids)
        for block in self.model.layers:
            x = block(x)
        return self.lm_head(self.model.norm(x))


class HandLinear(torch.nn.Module):
    """A W8A8 linear written from docs/matmul.md with torch's own float8 cast (the peer): x
    quantized with the stored static scale, or per token s = fp32(amax / 448) (1 where amax == 0);
    q = e4m3(clamp(fp32(x / s))); part = fp32(part + q_k * w_k) for k in order (one K-block: K <= 128);
    y = fp32(+0 + fp32(fp32(s_x * s_w) * part)). float32 in, float32 out."""

    def __init__(self, layer):
        super().__init__()
        import numpy as np

        self.w = torch.from_numpy(np.ascontiguousarray(layer.weight_codes)).view(torch.float8_e4m3fn).float()
        self.s_w = torch.from_numpy(np.asarray(layer.weight_scale).astype(np.float32)).reshape(1, -1)
        self.s_in = None if layer.input_scale is None else \
            torch.from_numpy(np.asarray(layer.input_scale).astype(np.float32)).reshape(1, 1)
        assert layer.quant.input in ("static", "dynamic-token") and layer.shape[1] <= 128

    def forward(self, x):
        lead = x.shape[:-1]
        x = x.reshape(-1, x.shape[-1])
        if self.s_in is not None:
            s_x = self.s_in
        else:
            amax = x.abs().amax(dim=1, keepdim=True)
            s_x = torch.where(amax == 0, torch.ones_like(amax), amax / 448.0)
        q = (x / s_x).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float()
        part = torch.zeros(x.shape[0], self.w.shape[0])
        for k in range(x.shape[1]):
            part = part + q[:, k:k + 1] * self.w[:, k][None, :]
        y = torch.zeros_like(part) + (s_x * self.s_w) * part
        return y.reshape(*lead, -1)
