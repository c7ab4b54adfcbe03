"""Taylor mode: `jet` as an interpreter level (taylor/level.py) with its own rule table
(taylor/rules.py, the recurrences of taylor/series.py)."""

from .api import jet
from .operators import bilaplacian, laplacian, weighted_laplacian
from .level import JET_RULES, JetLevel, JetTensor

__all__ = ["jet", "laplacian", "weighted_laplacian", "bilaplacian", "JetLevel", "JetTensor", "JET_RULES"]
