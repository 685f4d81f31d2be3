"""The bottom layer: errors, units, option parsing, the registry and the results schema; strategies/ and workloads/
build on it, and it imports nothing else of membench."""
