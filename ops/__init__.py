"""gemslib.ops: one file per operator (kernels, launcher, aten wrappers, declared overrides)."""
