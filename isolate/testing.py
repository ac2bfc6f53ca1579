"""Assertion helpers and a pytest plugin for gradient isolation (work in progress)."""

from __future__ import annotations
