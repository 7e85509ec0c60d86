"""The distribute stage: a built image reaches the nodes of a cluster (push, deploy, stream), runs there (launch).

It may import build, recipe and the shared modules (errors, files, net, gitfetch, imageref, registry, proc, inimage).
"""
