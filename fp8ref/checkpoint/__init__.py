"""FP8 safetensors checkpoints: load (``load_checkpoint``) and write (``export_checkpoint``)
the formats compressed-tensors/llm-compressor, auto-round and Hugging Face fp8 use."""

from .loader import Checkpoint, QuantizedLayer, load_checkpoint

__all__ = ["Checkpoint", "QuantizedLayer", "load_checkpoint"]
