"""Runnable examples: ``python -m fmoe.examples.helloworld``, ``python -m fmoe.examples.charlm``."""
