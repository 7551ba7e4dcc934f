"""gemslib's benchmark suite: one ``bench_<op>.py`` per operator; ``python -m benchmark`` runs it."""
