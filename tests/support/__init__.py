"""Helpers every tier shares, imported as `tests.support.X`.

paths: where things are. cli: one runner of the real command line and one check of a one-line error.
recipes: the shipped images without their locks, the layout that reads them, a small PyPI recipe.
docker: the engine check, build arguments, image IDs, a local registry. gitserver, gitsource,
fileserver: real HTTPS servers (git smart HTTP, files). drip: an HTTP server that answers a byte at a
time and never finishes. origins: HTTPS servers on two loopback addresses and two ports under one test
CA, and a plain-HTTP one, that record every request (where a credential went). upstream: real vLLM
sources for mods. hoststate: what the run must leave as it found it. users: the non-root member of `docker`
that walks the users' paths, and its login's environment.
"""
