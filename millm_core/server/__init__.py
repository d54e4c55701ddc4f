"""The HTTP layer: a Starlette app served by hypercorn."""
