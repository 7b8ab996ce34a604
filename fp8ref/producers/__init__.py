"""One module per external vocabulary (compressed-tensors, auto-round, Hugging Face fp8): each
parses and writes that producer's configs. ``QuantizationScheme`` translation, specs and the
checkpoint formats all go through these; a new producer is one module here plus one registered
``fp8ref.checkpoint`` format."""
