"""Command-line front ends: ``handoff`` (users and agents) and ``handoffd`` (the daemon)."""
