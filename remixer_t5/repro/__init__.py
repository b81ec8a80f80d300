"""Reproductions of paper experiments that run on a CPU (`remixer-t5 repro ...`)."""
