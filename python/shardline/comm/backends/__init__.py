"""Backends a ProcessGroup can run on: ``native`` (the Rust engine) and ``gloo`` (reference)."""

from __future__ import annotations

__all__ = ["gloo", "native"]
