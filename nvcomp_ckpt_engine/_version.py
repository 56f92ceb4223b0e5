"""The package's version, in a module of its own so that modules inside the package (and
setup.py, which reads this file as text) get it without importing the package's `__init__`."""

__version__ = "0.1.0"
