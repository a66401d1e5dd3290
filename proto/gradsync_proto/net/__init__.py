"""What every process needs beside the wire itself, none of it part of the protocol.

Dialing a coordinator, for every process that does: addresses, channel
security, diagnosis; and serving what a Prometheus scraper dials in to
(`exposition`), an HTTP endpoint of workers and coordinators alike.
"""
