"""The package version, in one place (tuning keys and benchmark records read it)."""
__version__ = "0.1.0"
