"""Test package; a package so that worker processes can import task functions as ``tests.*``."""
