"""The edge where fp8ref touches files: safetensors (one strict reader, one streaming writer),
strict YAML, JSON and text reading, atomic writes. Together with ``fp8ref.registry`` (the packaged
specs/) these are the only modules that open files."""

from . import gguf  # noqa: F401,E402  (registers the .gguf reader with safetensors.open_store)
