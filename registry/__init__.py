"""Baton's registry: the stateless gRPC server that owns the entry state machine in etcd."""

if __name__ != "baton_relay.registry":  # one import name per file
    raise ImportError(f"{__name__} is baton_relay.registry: import it by that name "
                      "(the repository's root is the package baton_relay)")


from .edge.config import RegistryConfig, load_config
from .edge.server import Running, start

__all__ = ["RegistryConfig", "Running", "load_config", "start"]
