"""Structured output: ``response_format`` constrains generation to one JSON document
(``json_object``) or to a JSON Schema from millm's supported subset (``json_schema``).

The engine-independent parts live beside the plugin: :mod:`.schema` (the subset, its
refusals and the final validation), :mod:`.vocab` (the constraint library's view of an
engine's vocabulary, cached on disk) and :mod:`.constraint` (the per-row token processor
that tells the engine which tokens may come next).
"""
