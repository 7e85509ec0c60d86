"""The recipe stage: from YAML recipes and mod folders to a frozen, resolved Plan; it never touches Docker.

It may import only the shared modules (errors, files, net, gitfetch, imageref, registry) and inimage.
"""
