"""Test infrastructure: extra dockerd nodes, the network-namespace cluster, process finders."""
