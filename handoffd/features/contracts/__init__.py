"""Seed 004 contracts: observed scope, exclusive file ownership, success criteria, violations."""
