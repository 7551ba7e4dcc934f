"""gemslib.fused: multi-stage kernels (attention, rms_norm_linear_silu), one file per operator."""
