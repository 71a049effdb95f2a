"""Oracle-conformance helpers and hypothesis strategies for testing other kernels
against refgeo (see the "Testing your implementation against refgeo" docs page)."""

__all__: list[str] = []
