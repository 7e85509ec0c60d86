"""The distribute stage: a built image reaches the nodes of a cluster.

It owns the cluster file and the registry process (cluster), reaching the nodes and their pulls
(nodes), image identity, registry deploys, status and history (deploy), pushing to a registry (push)
and `docker save | docker load` deploys (stream).

It may import build, recipe and the shared modules (errors, files, net, gitfetch, imageref, registry, inimage).
"""
