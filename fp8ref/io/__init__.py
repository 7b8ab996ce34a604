"""The edge where fp8ref touches files: safetensors (one strict reader, one streaming writer),
strict YAML, JSON and text reading, atomic writes. Together with ``fp8ref.registry`` (the packaged
specs/) these are the only modules that open files."""
