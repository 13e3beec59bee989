"""Communicators: the object that carries every cross-process exchange.

fmoe never reaches for a global process group. Functions that need other ranks
take a ``comm`` argument implementing :class:`Communicator`; ``None`` or
:class:`LocalComm` means a single process.
"""
from __future__ import annotations

from .base import Communicator, LocalComm, resolve

__all__ = ["Communicator", "LocalComm", "resolve"]
