"""Transparent capture: the nftables rules that send a sandbox's traffic to Sandgate, counted."""
