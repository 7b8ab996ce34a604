"""FP8 safetensors checkpoints: load (``load_checkpoint``) and write (``export_checkpoint``,
``write_checkpoint``) the formats compressed-tensors/llm-compressor, auto-round and Hugging Face
fp8 use. Modules: detect, one module per format, loader, forward,
export, inspect."""

from .export import export_checkpoint, load_calibration, write_checkpoint
from .loader import Checkpoint, QuantizedLayer, load_checkpoint

__all__ = ["Checkpoint", "QuantizedLayer", "export_checkpoint", "load_calibration", "load_checkpoint",
           "write_checkpoint"]
