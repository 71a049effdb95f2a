"""refgeo.lmo (see ARCHITECTURE.md); populated by its issue."""

__all__: list[str] = []
