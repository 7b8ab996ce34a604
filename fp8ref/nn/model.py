"""``build_model``: a whole model from a checkpoint folder, with transformers (the optional extra
``fp8ref[hf]``) and never a hub download: the architecture comes from the folder's config.json
(``AutoModelForCausalLM.from_config``), every unquantized tensor from the checkpoint through
fp8ref's own safetensors reader, and every quantized layer becomes an ``Fp8RefLinear``. A tensor
the model does not have, or a model tensor the checkpoint lacks (tied weights aside), is an error.

The model is built with its parameters on the meta device (no memory, no random initialisation:
every one is replaced), its buffers (rotary frequencies and the like, computed at construction)
real; each parameter the checkpoint supplies then becomes the tensor read from it. Memory beyond
the checkpoint's own unquantized bytes is one tensor at a time."""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import torch

from .._arrays import torch_of
from ..checkpoint import Checkpoint, load_checkpoint
from ..errors import ModelError
from .attention import install_kv_attention
from .config_check import check_config
from .experts import fuse_unquantized_experts
from .gptoss import swap_gptoss_experts
from .swap import swap_linears

INSTALL_HINT = "pip install 'fp8ref[hf]' (or: pip install transformers)"


def _transformers():
    try:
        import transformers
    except ImportError:
        raise ModelError(f"build_model needs transformers, which is not installed: {INSTALL_HINT}") from None
    return transformers


def _checkpoint(source, what: str):
    if source is None or isinstance(source, Checkpoint):
        return source
    return load_checkpoint(source)


def build_model(checkpoint, *, mode="reference", accumulate: str = "exact", backend=None, original=None,
                kv_cache: bool = True, keep_decoded: bool = False):
    """The model of ``checkpoint`` (a folder or a loaded Checkpoint) in ``mode``, in eval mode.

    original: the unquantized source (folder or Checkpoint) that ``mode="original"`` needs.
    backend: the backend object of a ``backend:NAME`` mode (or a mapping name -> backend).
    kv_cache: quantize K and V with the checkpoint's KV-cache scales, if it has any
    (``fp8ref.nn.attention``); False leaves attention unquantized in every mode.
    keep_decoded: every layer keeps its float64 weight between exact forwards (8 bytes per weight
    element, ``Fp8RefLinear``); the default (False) keeps nothing, for models of any size.
    original: a folder's tensors are read when a layer runs in mode "original", not held.
    """
    tf = _transformers()
    ckpt = _checkpoint(checkpoint, "checkpoint")
    orig = _checkpoint(original, "original")
    cfg = dict(ckpt.config)
    where = f"{ckpt.path}/config.json" if ckpt.path.is_dir() else str(ckpt.path)
    if not cfg:
        raise ModelError(f"{where}: no config.json; build_model needs the model's configuration")
    cfg.pop("quantization_config", None)  # the layers are fp8ref's; transformers must not quantize
    model_type = cfg.pop("model_type", None)
    if not isinstance(model_type, str):
        raise ModelError(f"{where}: no 'model_type'; expected e.g. \"llama\"")
    check_config(tf, model_type, cfg, ckpt, where)  # before transformers allocates anything from it
    try:
        config = tf.AutoConfig.for_model(model_type, **cfg)
    except (ValueError, KeyError) as exc:
        raise ModelError(f"{where}: model_type {model_type!r}: transformers {tf.__version__} cannot build it "
                         f"({exc})") from None
    dtype = getattr(torch, ckpt.dtype)
    with parameters_on_meta():
        model = tf.AutoModelForCausalLM.from_config(config, dtype=dtype)
    report = swap_linears(model, ckpt, mode=mode, accumulate=accumulate, backend=backend, original=orig,
                          keep_decoded=keep_decoded)

    swap_gptoss_experts(model, ckpt, report, mode=mode, original=orig)  # gpt-oss's fused MXFP4 experts (not nn.Linear)
    report.raise_unplaced(str(ckpt.path))
    load_unquantized(model, ckpt)
    if kv_cache:
        install_kv_attention(model, ckpt, mode, backend)
    return model.eval()


@contextmanager
def parameters_on_meta():
    """Inside: every parameter a module registers is moved to the meta device as it is registered
    (the values a constructor initialises it with are not kept, an initialiser run on it later does
    nothing); buffers stay where they are made. ``load_unquantized`` gives the parameters their data."""
    register = torch.nn.Module.register_parameter

    def on_meta(module, name, param):
        if param is not None and param.device.type != "meta":
            param = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    torch.nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def load_unquantized(model: torch.nn.Module, ckpt) -> None:
    """Give every parameter and buffer of ``model`` its tensor from ``ckpt`` by name (a parameter on
    the meta device becomes the tensor read, in the parameter's dtype; a real one is copied into);
    per-expert tensors of unquantized experts are stacked into the fused parameters first. A
    checkpoint tensor without a model tensor, or a model tensor that neither the checkpoint nor a
    tied weight supplies, is an error."""
    fused, consumed = fuse_unquantized_experts(model, ckpt)  # per-expert tensors -> the fused parameters
    state = model.state_dict(keep_vars=True)
    given = set(ckpt.unquantized) - consumed | set(fused)
    extra = sorted(given - set(state))
    if extra:
        raise ModelError(f"{ckpt.path}: {len(extra)} tensors the model has no place for, e.g. {extra[:3]}")
    shared: dict[int, set[str]] = {}  # tied parameters are one object under several names
    for name, p in model.named_parameters(remove_duplicate=False):
        shared.setdefault(id(p), set()).add(name)
    tied = {n for names in shared.values() if names & given for n in names}
    missing = sorted(set(state) - given - tied)
    if missing:
        raise ModelError(f"{ckpt.path}: {len(missing)} model tensors missing from the checkpoint, e.g. {missing[:3]}")
    for name in sorted(given):
        old = state[name]
        shape = tuple(fused[name].shape) if name in fused else tuple(ckpt.store.info(name).shape)
        if shape != tuple(old.shape):
            where = f"{ckpt.path}: {name} (stacked from its experts)" if name in fused else ckpt.store.where(name)
            raise ModelError(f"{where}: shape {list(shape)}, the model's {list(old.shape)}")
        t = fused[name] if name in fused else _tensor(ckpt, name)
        with torch.no_grad():
            if old.device.type != "meta":
                old.copy_(t)
                continue
            new = torch.nn.Parameter(t.to(old.dtype), requires_grad=False)
        for alias in shared.get(id(old), {name}):
            owner, _, attr = alias.rpartition(".")
            model.get_submodule(owner)._parameters[attr] = new
    left = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    if left:  # a parameter outside the state dict (none in transformers' models)
        raise ModelError(f"{ckpt.path}: {len(left)} model parameters the checkpoint does not supply, e.g. {left[:3]}")


def _tensor(ckpt, name: str) -> torch.Tensor:
    """The checkpoint tensor ``name`` as torch, sharing the freshly read buffer (no second copy)."""
    a = ckpt.tensor(name)
    if a.dtype.name in ("bfloat16", "float16"):
        return torch.from_numpy(a.view(np.int16)).view(getattr(torch, a.dtype.name))
    return torch.from_numpy(a) if a.flags.writeable else torch_of(a)
