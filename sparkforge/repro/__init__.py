"""The checks of a recipe and its images: do the mods apply, is the build reproducible, what changed, what
is newer.

It owns check-mods (checkmods), verify-repro (repro), diff (diff), outdated (outdated) and the library
entries of those verbs (verbs).

It may import distribute, build, recipe and the shared modules (errors, files, net, gitfetch, imageref, registry, proc, inimage).
"""
