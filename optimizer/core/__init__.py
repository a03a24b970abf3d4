"""The ground floor: errors, units, clocks, processes, paths, signals; every stage above may use it."""
