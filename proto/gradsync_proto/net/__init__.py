"""Dialing a coordinator, for every process that does: addresses, channel security, diagnosis."""
