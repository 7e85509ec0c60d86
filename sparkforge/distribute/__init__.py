"""The distribute stage: a built image reaches the nodes of a cluster.

It owns the cluster file and the registry process (cluster), reaching the nodes and their pulls
(nodes), which image is where and the head's record and builds (images), the deploy loop, registry
deploys and status (deploy), pushing to a registry (push) and `docker save | docker load` deploys
(stream).

It may import build, recipe and the shared modules (errors, files, net, gitfetch, imageref, registry, proc, inimage).
"""
