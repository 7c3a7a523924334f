"""Decisions shared across the ranks of a process group (see docs/distributed.md).

Without an initialised default process group a decision is the process's own.
"""
from __future__ import annotations

from typing import Sequence

from ..lowerings.rule import Rule
from ..lowerings.site import ConvSite
from .decision import Decision


def agree(site: ConvSite, candidates: Sequence[Rule], decision: Decision) -> Decision:
    """The decision every rank takes for ``site``."""
    return decision
