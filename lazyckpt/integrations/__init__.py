"""Adapters that plug lazyckpt into training frameworks; each is an optional extra.

Import the one you use (``lazyckpt.integrations.deepspeed``, ...): importing this package
imports no framework.
"""
