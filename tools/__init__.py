"""Project tools: the regression sources and runs, and the facts the docs tables are rendered from.

Imported as ``tools.<module>`` by the tests; each script also runs as ``python tools/<module>.py``.
"""
