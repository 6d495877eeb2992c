"""Kernel classes. Each answers `supports(args)` with a Status before anything compiles."""
