"""The Triton backend: lowering rules, the kernel emitter and the tiled kernel class."""
