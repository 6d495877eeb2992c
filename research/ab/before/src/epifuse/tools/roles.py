"""The roles an operand can be given: on the command line (`--role NAME=ROLE`, checked while the
arguments parse, before torch loads) and in tools.problems' random arguments."""
ROLES = ("number", "scalar", "row", "col", "tile", "batch")
