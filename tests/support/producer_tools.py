"""The producer tools' own CPU code, loaded for the ``tools`` tests (tox -e tools) and
tools/make_tool_fixtures.py. Each loader returns None when its tool is absent.

* TransformerEngine 2.20.2: the pure-PyTorch reference quantizers it ships
  (``transformer_engine/pytorch/custom_recipes/reference_{current_scaling,nvfp4}.py``, the references its
  tests hold the CUDA kernels to). ``import transformer_engine`` refuses to run without its CUDA core
  library ("Found empty `transformer-engine` meta package installed"), so each file is executed on its
  own with three of its imports stubbed: ``quantized_tensor.Quantizer`` (TE's ``__init__`` body: the
  four usage attributes), ``quantized_tensor.QuantizedTensorStorage`` (an empty base class) and the
  ``custom_recipes.gemm`` module (only its ``MMParams``/``GEMMType`` names, used by ``qgemm``, which is
  not called). ``reference_utils`` is TE's own file. The quantization arithmetic is TE's, untouched.
* vLLM 0.33.0 (installed with ``--no-deps``; ``vllm._C`` is absent and vLLM tolerates that):
  ``QuantFP8.forward_native`` and ``per_token_group_quant_fp8``, whose Triton fallback runs in Triton's
  CPU interpreter (``TRITON_INTERPRET=1``, ``CUDA_VISIBLE_DEVICES=`` so vLLM keeps Triton without an
  active GPU driver). Both variables must be set before vLLM or Triton is imported.
* DeepGEMM (not on PyPI as itself): ``deep_gemm/utils/math.py``, executed as it is (it imports only
  torch), from the copy vLLM 0.33.0 bundles (``vllm/third_party/deep_gemm``, DeepGEMM 2.8.1) and from a
  checkout (``FP8REF_DEEPGEMM``, the repo root). That runs DeepGEMM's host-side cast functions, not its
  CUDA GEMM.

* SGLang 0.5.23 (installed with ``--no-deps``; its modules import sgl_kernel and CUDA code, so nothing of
  it is imported): the pure-torch functions of ``srt/layers/quantization/fp8_utils.py`` that its
  ``requant_weight_ue8m0`` runs (``block_quant_dequant``, ``per_block_cast_to_fp8``, ``ceil_to_ue8m0``) and
  ``ceil_align``/``ceil_div`` of ``srt/utils/common.py``, taken out of the files with ``ast`` and executed
  as they are (``sglang_fp8_functions``).

* FBGEMM (fbgemm-gpu-genai 1.9.0, installed with ``--no-deps``): ``quantize_fp8_row`` of
  ``fbgemm_gpu/experimental/gemm/triton_gemm/fp8_gemm.py``, whose CPU path is PyTorch (recipe ``fbgemm``).
  The package ``__init__``s of ``fbgemm_gpu``, ``fbgemm_gpu.experimental`` and ``fbgemm_gpu.experimental.gemm``
  are skipped (empty package modules with their real ``__path__``): they load the CUDA libraries.

What does not load here, and why: ``vllm._C_stable_libtorch.abi3.so`` (vLLM's CUDA kernels, e.g.
``per_token_group_fp8_quant``, ``scaled_fp8_quant``): ``libcuda.so.1: cannot open shared object file``.
TE's CUDA kernels are in ``transformer_engine_cu12`` (not installable without CUDA). fbgemm-gpu-cpu 1.9.0
has no ``quantize_fp8_per_row`` at all and its libraries fail under torch 2.13.0 (undefined symbol
``torch::autograd::_wrap_outputs``).
"""

from __future__ import annotations

import enum
import importlib.util
import os
import sys
import types
from pathlib import Path


def native_recipes() -> dict:
    """What the tools' PyTorch paths compute, as fp8ref recipe variants (checked bit for bit): vLLM's
    QuantFP8.forward_native ("token", "group") and FBGEMM's quantize_fp8_row on CPU ("fbgemm-cpu")."""
    from dataclasses import replace

    import ml_dtypes

    from fp8ref.registry import get_recipe
    return {
        # max_fp8 / row_max is Python float / tensor, which torch computes as row_max.reciprocal() * 448
        # (two roundings), and the eps clamp runs in the input dtype (bf16(1e-12) for bf16 inputs)
        "fbgemm-cpu": replace(get_recipe("fbgemm"), name="fbgemm-cpu", scale_form="1/(max*(1/amax))",
                              amax_min=float(ml_dtypes.bfloat16(1e-12))),
        # per token: (amax / 448).clamp(min=1/(448*512)), then x * scale.reciprocal() (the kernel divides)
        "token": replace(get_recipe("vllm-dynamic"), name="vllm-native-token", apply_op="multiply_reciprocal"),
        # per 1x128 group: the same floor on the scale (not the kernels' eps 1e-10 on amax), then x / scale
        "group": replace(get_recipe("vllm-group"), name="vllm-native-group", amax_min=None, scale_min=1 / 229376),
    }


def _exec_file(name: str, path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def te_version() -> str | None:
    try:
        from importlib.metadata import version
        return version("transformer_engine")
    except Exception:
        return None


def te_reference(name: str) -> types.ModuleType | None:
    """TE's ``custom_recipes/<name>.py`` (``reference_current_scaling`` or ``reference_nvfp4``)."""
    spec = importlib.util.find_spec("transformer_engine")
    if spec is None or spec.origin is None:
        return None
    folder = Path(spec.origin).parent / "pytorch" / "custom_recipes"
    if not (folder / f"{name}.py").is_file():
        return None

    class Quantizer:  # TE's Quantizer.__init__ body (quantized_tensor.py)
        def __init__(self, *, rowwise: bool, columnwise: bool) -> None:
            self.rowwise_usage = rowwise
            self.columnwise_usage = columnwise
            self.internal = False
            self.optimize_for_gemm = False

    class QuantizedTensorStorage:
        pass

    qt = types.ModuleType("transformer_engine.pytorch.quantized_tensor")
    qt.Quantizer, qt.QuantizedTensorStorage = Quantizer, QuantizedTensorStorage
    gemm = types.ModuleType("transformer_engine.pytorch.custom_recipes.gemm")
    gemm.MMParams = object
    gemm.GEMMType = enum.Enum("GEMMType", "FPROP DGRAD WGRAD")
    stubs = {
        "transformer_engine": types.ModuleType("transformer_engine"),
        "transformer_engine.pytorch": types.ModuleType("transformer_engine.pytorch"),
        "transformer_engine.pytorch.custom_recipes": types.ModuleType("transformer_engine.pytorch.custom_recipes"),
        "transformer_engine.pytorch.quantized_tensor": qt,
        "transformer_engine.pytorch.custom_recipes.gemm": gemm,
    }
    saved = {k: sys.modules.get(k) for k in [*stubs, "transformer_engine.pytorch.custom_recipes.reference_utils"]}
    try:
        sys.modules.update(stubs)
        utils = _exec_file("transformer_engine.pytorch.custom_recipes.reference_utils", folder / "reference_utils.py")
        sys.modules["transformer_engine.pytorch.custom_recipes.reference_utils"] = utils
        stubs["transformer_engine.pytorch.custom_recipes"].gemm = gemm
        stubs["transformer_engine.pytorch.custom_recipes"].reference_utils = utils
        return _exec_file(f"_te_{name}", folder / f"{name}.py")
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v


def vllm_modules() -> dict | None:
    """vLLM's QuantFP8, GroupShape, fp8_utils and a config context for constructing custom ops."""
    if importlib.util.find_spec("vllm") is None:
        return None
    if os.environ.get("TRITON_INTERPRET") != "1" or os.environ.get("CUDA_VISIBLE_DEVICES") != "":
        raise RuntimeError("set TRITON_INTERPRET=1 and CUDA_VISIBLE_DEVICES= before importing vLLM")
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8
    from vllm.model_executor.layers.quantization.utils import fp8_utils
    from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape

    def context():
        return set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu")))

    return {"QuantFP8": QuantFP8, "GroupShape": GroupShape, "fp8_utils": fp8_utils, "context": context}


def sglang_fp8_functions() -> dict | None:
    """SGLang's UE8M0 requantization functions, executed from its files without importing SGLang."""
    import ast

    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.origin:
        return None
    root = Path(spec.origin).parent / "srt"
    wanted = {root / "layers" / "quantization" / "fp8_utils.py": ("block_quant_dequant", "per_block_cast_to_fp8",
                                                                   "ceil_to_ue8m0"),
              root / "utils" / "common.py": ("ceil_align", "ceil_div")}
    import __future__

    import torch

    namespace = {"torch": torch}  # annotations stay strings, as in SGLang's own files (from __future__)
    for path, names in wanted.items():
        tree = ast.parse(path.read_text())
        defs = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in names]
        if len(defs) != len(names):
            return None
        code = compile(ast.Module(body=defs, type_ignores=[]), str(path), "exec",
                       flags=__future__.annotations.compiler_flag, dont_inherit=True)
        exec(code, namespace)  # noqa: S102
    return namespace


def fbgemm_fp8_gemm() -> types.ModuleType | None:
    """fbgemm_gpu.experimental.gemm.triton_gemm.fp8_gemm (fbgemm-gpu-genai), without the CUDA package inits."""
    spec = importlib.util.find_spec("fbgemm_gpu")
    if spec is None or not spec.submodule_search_locations:
        return None
    root = Path(next(iter(spec.submodule_search_locations)))
    if not (root / "experimental" / "gemm" / "triton_gemm" / "fp8_gemm.py").is_file():
        return None
    for name, folder in (("fbgemm_gpu", root), ("fbgemm_gpu.experimental", root / "experimental"),
                         ("fbgemm_gpu.experimental.gemm", root / "experimental" / "gemm")):
        if name not in sys.modules:
            package = types.ModuleType(name)
            package.__path__ = [str(folder)]
            sys.modules[name] = package
    return importlib.import_module("fbgemm_gpu.experimental.gemm.triton_gemm.fp8_gemm")


def deepgemm_math(source: str) -> types.ModuleType | None:
    """``deep_gemm/utils/math.py`` from ``source``: "vllm" (vLLM's bundled copy) or "checkout"."""
    if source == "vllm":
        spec = importlib.util.find_spec("vllm")
        root = Path(spec.origin).parent / "third_party" if spec and spec.origin else None
    else:
        root = Path(os.environ["FP8REF_DEEPGEMM"]) if os.environ.get("FP8REF_DEEPGEMM") else None
    path = root / "deep_gemm" / "utils" / "math.py" if root else None
    if path is None or not path.is_file():
        return None
    return _exec_file(f"_deepgemm_math_{source}", path)
