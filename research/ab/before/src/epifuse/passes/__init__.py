"""Graph -> Graph passes. `pipeline.optimize` runs them in the order listed there."""
from .pipeline import PIPELINE, canonical_hash, optimize

__all__ = ["PIPELINE", "optimize", "canonical_hash"]
