"""Check: the fp64 reference, random cases, and `specgen test` on a GPU."""
