"""The checks of a recipe and its images: do the mods apply (checkmods), is the build reproducible (repro), what
changed (diff), what is newer (outdated); verbs holds their library entries.

It may import distribute, build, recipe and the shared modules (errors, files, net, gitfetch, imageref, registry, proc, inimage).
"""
