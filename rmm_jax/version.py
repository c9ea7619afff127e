"""The package version, in one place (pyproject reads it too)."""
__version__ = "0.2.0"
