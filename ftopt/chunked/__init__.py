"""The chunked CPU backend: eager steps and rule bodies run as traced programs over
cache-sized chunks of all leaves (:mod:`ftopt.chunked.entry`)."""
