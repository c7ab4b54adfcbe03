"""Batching rules, one module per op family. Importing this package fills `VMAP_RULES`."""

from . import data_dependent, factory, pointwise, random, reductions, views  # noqa: F401
