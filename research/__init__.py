"""Research probes: the measurements behind epifuse's design decisions (research/README.md).

Not part of the library or its support promise. Each probe runs from the repository root as
``PYTHONPATH=src:. python -m research.<probe>``; its docstring gives the options and
NOTEBOOK.md the history of what it found. The probes reuse the product benchmark's workloads
and timing (``bench``).
"""
