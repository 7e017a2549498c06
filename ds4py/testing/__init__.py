"""Test-only helpers that ship with the package so that a spawned `ds4py serve` can use them (never a default)."""
