"""Tools around the library: tracing a tile, drawing the DAG, problems to try, profiler output."""
