"""The top layer: assembles a node (worker process, gateway, QUIC tunnels, gossip, discovery) and
holds the CLI. Imports go ``mesh → gateway → worker``, never back."""
