"""What the tests share: child processes a test starts (crash and drain children, rank
workers), the helpers that launch ranks, and the gates that hold a Checkpointer's stages.

The children and workers run as scripts (``python tests/helpers/crash_child.py ...``); each
puts the folder above this package on ``sys.path`` first, so that they import one another as
``helpers.<name>`` the way the tests do.
"""
