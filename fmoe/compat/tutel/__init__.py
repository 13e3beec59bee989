"""Tutel's public surface over fmoe: ``from fmoe.compat.tutel import moe, system, net``.

A Tutel script runs after one change to its imports::

    from tutel import moe, system, net            # before
    from fmoe.compat.tutel import moe, system, net   # after
    import fmoe.compat.tutel as tutel             # for ``import tutel``

Conventions kept from Tutel (and only here; the functional core keeps none):

* parameters are drawn from the global torch RNG in Tutel's exact order
  (``seeds`` reseed it), gate noise and dropout use the global RNG too, and
  parameters take ``torch.get_default_dtype()``;
* ``moe_layer`` stores ``l_aux``, ``dispatch_count``, ``protected_shape``
  after each forward, and the per-call ``a2a_ffn_overlap_degree`` and
  ``adaptive_r`` stick (they overwrite ``a2a_ffn_overlap_degree`` /
  ``adaptive_degree``), as Tutel's scripts read them back;
* ``group=None`` means the default world group of the job;
* ``system`` and ``net`` keep one session and a cache of process groups.

Where Tutel is wrong, fmoe's behaviour is kept; README "Migrating from Tutel"
lists every difference.
"""
from . import moe, net, system

system_init = system  # Tutel's ``tutel/__init__`` imports system under this name

__all__ = ["moe", "net", "system"]
