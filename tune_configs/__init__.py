"""gemslib.tune_configs: launch configurations per GPU model as YAML (see README.md here)."""
