"""Parallelism strategies: data parallel (this spine); tensor, pipeline and 3D later."""
