"""Drop-in integrations of lazyckpt with training frameworks, one optional module each.

Each module imports its framework on import and is installed with the matching extra
(``pip install lazyckpt[lightning]``, ``lazyckpt[huggingface]``, ...). See
``docs/integrations.md``.
"""
