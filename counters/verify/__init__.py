"""Repairs against the truth: rebuild and audit."""
