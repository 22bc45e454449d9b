"""Local stand-ins for a fleet's parts: generated models, Redis, S3 and vLLM processes.

Used by the test suite, `kvpool demo` and `kvpool bench`. Everything binds to loopback
on free ports and is torn down by its owner.
"""
