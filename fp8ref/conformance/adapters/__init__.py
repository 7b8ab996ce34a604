"""Built-in backend adapters. Each imports its peer library lazily (on first use), so
importing fp8ref never imports torch, ml_dtypes, gfloat, compressed-tensors or auto-round."""
