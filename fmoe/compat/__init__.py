"""Compatibility front-ends for code written against other MoE libraries.

* :mod:`fmoe.compat.tutel`: Tutel's public surface (``moe``, ``system``,
  ``net``), so a Tutel script runs after only its import lines change.

A compat layer is the one place where another library's stateful conventions
(attributes stored after a forward, the global RNG, module-level caches) are
kept; it wraps fmoe's functional core, which stays stateless.
"""
