"""What tests share (no test module imports another): independent oracles (oracle, quant_oracle,
matmul_oracle), checkpoint builders, deliberately broken backends and the one CLI runner."""
