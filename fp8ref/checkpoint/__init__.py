"""FP8 safetensors checkpoints: load (``load_checkpoint``) and write (``export_checkpoint``,
``write_checkpoint``) the formats compressed-tensors/llm-compressor, auto-round, Hugging Face
fp8, ModelOpt, Quark and FBGEMM use. Modules: detect, one module per format, loader, forward,
export (calibration_file, plan, scales, writer), convert, inspect."""

# the built-in formats register themselves (fp8ref.checkpoint.base.register), before anything asks
from . import auto_round, compressed_tensors, fbgemm_fp8, hf_fp8, modelopt, quark  # noqa: F401  isort: skip
from . import gptoss  # noqa: F401  isort: skip
from . import gguf, torchao  # noqa: F401  isort: skip
from .calibration_file import load_calibration, write_calibration
from .convert import write_checkpoint
from .export import export_checkpoint
from .loader import Checkpoint, QuantizedLayer, load_checkpoint

__all__ = ["Checkpoint", "QuantizedLayer", "export_checkpoint", "load_calibration", "load_checkpoint",
           "write_calibration", "write_checkpoint"]
