"""The package's version: also the engine version ``pgque.version()`` reports."""

__version__ = "0.14.0"
